"""Shared by the eval tests: tiny GLUE folders in the official layouts, and tiny trained
runs made by the real trainer (cached per test session: each takes a few seconds)."""

from __future__ import annotations

import random
from pathlib import Path

from conftest import REPO, TINY
from ember.config import load_config
from ember.train.trainer import Trainer

WORDS = ("the cat sat on a mat while dogs ran past old trees near quiet rivers and small "
         "houses stood by roads that led to markets full of bread fish and fruit").split()

HEADERS = {
    "SST-2": ["sentence", "label"],
    "MRPC": ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "QQP": ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
    "STS-B": ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
              "score"],
    "QNLI": ["index", "question", "sentence", "label"],
    "RTE": ["index", "sentence1", "sentence2", "label"],
}
MNLI_TRAIN = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
              "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
MNLI_DEV = MNLI_TRAIN[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
CLASSES = {"MNLI": ["contradiction", "entailment", "neutral"], "QNLI": ["entailment", "not_entailment"],
           "RTE": ["entailment", "not_entailment"]}
KEYWORDS = ["red", "blue", "green"]  # class k's sentence b ends with KEYWORDS[k]


def sentence(rng: random.Random, low: int = 3, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def example(rng: random.Random, label: int) -> tuple[str, str]:
    """A pair whose label is the last word of its second sentence: learnable, but only
    by a model that reads the end of the input."""
    return sentence(rng), sentence(rng) + " " + KEYWORDS[label]


def _row(folder: str, i: int, a: str, b: str, label, split: str) -> list[str]:
    if folder == "CoLA":
        return ["src", str(label), "" if label else "*", b]
    if folder == "SST-2":
        return [b, str(label)]
    if folder == "MRPC":
        return [str(label), str(2 * i), str(2 * i + 1), a, b]
    if folder == "QQP":
        return [str(i), str(2 * i), str(2 * i + 1), a, b, str(label)]
    if folder == "STS-B":
        return [str(i), "main-captions", "MSRvid", "2012test", str(i), "none", "none", a, b, f"{label:.3f}"]
    if folder == "MNLI":
        name = CLASSES["MNLI"][label]
        fill = ["(x)", "(y)", "(ROOT x)", "(ROOT y)", a, b, name] + ([name] * 4 if split != "train" else [])
        return [str(i), str(i), f"{i}e", "fiction", *fill, name]
    return [str(i), a, b, CLASSES[folder][label]]


def write_glue(root: Path, sizes: tuple[int, int] = (24, 12), seed: int = 0,
               folders=("CoLA", "SST-2", "MRPC", "QQP", "STS-B", "MNLI", "QNLI", "RTE")) -> Path:
    """A GLUE folder with `sizes` (train, dev) rows per file, labels balanced."""
    rng = random.Random(seed)
    for folder in folders:
        (root / folder).mkdir(parents=True, exist_ok=True)
        files = {"train.tsv": sizes[0]}
        files.update({"dev_matched.tsv": sizes[1], "dev_mismatched.tsv": sizes[1]} if folder == "MNLI"
                     else {"dev.tsv": sizes[1]})
        for name, n in files.items():
            split = name.removesuffix(".tsv")
            header = (MNLI_TRAIN if split == "train" else MNLI_DEV) if folder == "MNLI" else HEADERS.get(folder)
            lines = [header] if header else []
            for i in range(n):
                label = i % (3 if folder == "MNLI" else 2)
                a, b = example(rng, label)
                value = 5.0 * label if folder == "STS-B" else label
                lines.append(_row(folder, i, a, b, value, split))
            (root / folder / name).write_text("".join("\t".join(row) + "\n" for row in lines))
    return root


_RUNS: dict[str, Path] = {}


def trained_run(objective: str, dataset: Path, tmp_path_factory, steps: int = 20) -> Path:
    """A tiny run of `objective` trained for `steps` by the real trainer, once per session."""
    if objective not in _RUNS:
        overrides = TINY + [f"model.objective={objective}", "train.eval_every=10steps"]
        config = load_config(REPO / "configs/tiny-gpt.toml", overrides)
        run_dir = tmp_path_factory.mktemp(f"run-{objective}")
        Trainer(config, dataset, run_dir, budget=f"{steps}steps", progress=False).run()
        _RUNS[objective] = run_dir
    return _RUNS[objective]
