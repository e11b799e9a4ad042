"""The GLUE tasks as the official download lays them out: one folder per task holding
train.tsv and dev.tsv (MNLI: dev_matched.tsv and dev_mismatched.tsv).

Files are split on tabs without any quoting rules, as GLUE's own loaders do: its
sentences contain unbalanced quote characters. Columns are found by their header names
(CoLA has no header: source, label, original label, sentence). WNLI is left out, as in
BERT and Cramming: its dev set is adversarial to the train set and every model scores
the majority class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ember.data import DataError


@dataclass(frozen=True)
class Task:
    key: str  # what --tasks calls it
    folder: str  # the official folder name
    text_a: str | int  # header name, or the column index in a headerless file
    text_b: str | int | None
    label: str | int
    classes: tuple[str, ...] | None  # label values in class order; None for regression
    metrics: tuple[str, ...]
    dev: tuple[tuple[str, str], ...]  # (result column, file): MNLI scores two dev sets
    label_last: bool = False  # MNLI and STS-B: the label is the last column
    columns: int = 0  # headerless files only: how many columns a row has

    def layout(self) -> str:
        if not isinstance(self.text_a, str):
            return (f"{self.columns} tab-separated columns without a header "
                    "(source, label, original label, sentence)")
        names = [n for n in (self.text_a, self.text_b, self.label) if n]
        return f"a tab-separated header naming {', '.join(repr(n) for n in names)}"


BINARY, NLI2 = ("0", "1"), ("entailment", "not_entailment")
TASKS = {t.key: t for t in (
    Task("cola", "CoLA", 3, None, 1, BINARY, ("matthews",), (("CoLA", "dev.tsv"),), columns=4),
    Task("sst2", "SST-2", "sentence", None, "label", BINARY, ("accuracy",), (("SST-2", "dev.tsv"),)),
    Task("mrpc", "MRPC", "#1 String", "#2 String", "Quality", BINARY, ("f1", "accuracy"), (("MRPC", "dev.tsv"),)),
    Task("stsb", "STS-B", "sentence1", "sentence2", "score", None, ("pearson", "spearman"),
         (("STS-B", "dev.tsv"),), label_last=True),
    Task("qqp", "QQP", "question1", "question2", "is_duplicate", BINARY, ("f1", "accuracy"), (("QQP", "dev.tsv"),)),
    Task("mnli", "MNLI", "sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral"),
         ("accuracy",), (("MNLI-m", "dev_matched.tsv"), ("MNLI-mm", "dev_mismatched.tsv")), label_last=True),
    Task("qnli", "QNLI", "question", "sentence", "label", NLI2, ("accuracy",), (("QNLI", "dev.tsv"),)),
    Task("rte", "RTE", "sentence1", "sentence2", "label", NLI2, ("accuracy",), (("RTE", "dev.tsv"),)),
)}
# The result columns in the order of the BERT and Cramming tables.
SCORES = (0.0, 5.0)  # the similarity scale of STS-B, the one task scored by regression
COLUMNS = ("MNLI-m", "MNLI-mm", "QQP", "QNLI", "SST-2", "CoLA", "STS-B", "MRPC", "RTE")


def parse_tasks(text: str | None) -> list[Task]:
    """'cola,sst-2,STS-B' -> tasks; None -> all of them."""
    if text is None:
        return list(TASKS.values())
    chosen = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        key = name.lower().replace("-", "").replace("_", "")
        if key not in TASKS:
            raise DataError(f"--tasks names {name!r}, which is not a GLUE task here; "
                            f"choose from {', '.join(TASKS)}.")
        if TASKS[key] not in chosen:
            chosen.append(TASKS[key])
    if not chosen:
        raise DataError(f"--tasks is empty; choose from {', '.join(TASKS)}.")
    return chosen


@dataclass
class Split:
    text_a: list[str]
    text_b: list[str] | None
    labels: list  # class indices, or floats for regression
    skipped: int  # malformed rows left out (GLUE's QQP has a few)

    def __len__(self) -> int:
        return len(self.labels)


def task_folder(glue_dir: Path, task: Task) -> Path:
    """The task's folder; 'SST-2', 'sst2' and 'SST_2' are all accepted."""
    glue_dir = Path(glue_dir)
    if not glue_dir.is_dir():
        raise DataError(f"--glue-dir {glue_dir} is not a folder; point it at the unpacked GLUE data "
                        "(one folder per task, such as CoLA/ and MRPC/).")
    exact = glue_dir / task.folder
    if exact.is_dir():
        return exact
    for child in glue_dir.iterdir():
        if child.is_dir() and child.name.lower().replace("-", "").replace("_", "") == task.key:
            return child
    raise DataError(f"{glue_dir} has no {task.folder} folder; add it or leave {task.key} out of --tasks.")


def _rows(path: Path) -> list[list[str]]:
    if not path.is_file():
        raise DataError(f"{path} is missing; the GLUE {path.parent.name} folder needs train and dev files "
                        "as the official download lays them out.")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; use the files of the official GLUE download.") from None
    # Rows end at newlines only: str.splitlines would also cut a sentence at U+0085, U+2028
    # or a form feed, which are text inside a GLUE field, not row ends.
    return [line.rstrip("\r").split("\t") for line in text.split("\n") if line.strip()]


def read_split(task: Task, path: Path) -> Split:
    rows = _rows(path)
    if isinstance(task.text_a, str):
        header, rows = (rows[0], rows[1:]) if rows else ([], [])
        missing = [n for n in (task.text_a, task.text_b, task.label) if n and n not in header]
        if missing or (task.label_last and header[-1] != task.label):
            problem = f"lacks the column {missing[0]!r}" if missing else f"does not end with {task.label!r}"
            raise DataError(f"{path}'s header {problem}; expected {task.layout()}, as in the official GLUE files.")
        where = {n: header.index(n) for n in (task.text_a, task.text_b, task.label) if n}
    else:
        where = {task.text_a: task.text_a, task.label: task.label}
    label_at = -1 if task.label_last else where[task.label]
    a_at, b_at = where[task.text_a], where.get(task.text_b)
    needed = max(i for i in where.values()) + 1
    split = Split([], [] if task.text_b is not None else None, [], 0)
    problems = []
    for number, row in enumerate(rows, start=2 if isinstance(task.text_a, str) else 1):
        problem = _check_row(task, row, needed, label_at)
        if problem:
            problems.append(f"line {number} {problem}")
            continue
        split.text_a.append(row[a_at])
        if b_at is not None:
            split.text_b.append(row[b_at])
        value = row[label_at].strip()
        split.labels.append(float(value) if task.classes is None else task.classes.index(value))
    split.skipped = len(problems)
    # Tolerate the odd broken row of the large official files, never a broken format.
    if not split.labels or len(problems) > len(rows) // 1000:
        first = problems[0] if problems else "holds no examples"
        raise DataError(f"{path} {first}; expected {task.layout()}, as in the official GLUE files.")
    return split


def _check_row(task: Task, row: list[str], needed: int, label_at: int) -> str | None:
    if task.columns and len(row) != task.columns or len(row) < needed:
        return f"has {len(row)} columns"
    value = row[label_at].strip()
    if task.classes is None:
        try:
            score = float(value)
        except ValueError:
            score = math.nan
        if not SCORES[0] <= score <= SCORES[1]:  # also refuses nan
            return f"has the score {value!r}, not a number from {SCORES[0]:g} to {SCORES[1]:g}"
    elif value not in task.classes:
        return f"has the label {value!r}, not one of {', '.join(task.classes)}"
    return None


@dataclass
class TaskData:
    task: Task
    train: Split
    dev: dict[str, Split]  # result column -> split


def load_task(glue_dir: Path, task: Task) -> TaskData:
    folder = task_folder(glue_dir, task)
    return TaskData(task, read_split(task, folder / "train.tsv"),
                    {column: read_split(task, folder / name) for column, name in task.dev})
