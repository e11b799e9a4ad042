"""The built-in demo corpus: docstrings of the Python standard library on this machine.

Every Python installation carries a few megabytes of carefully written English about
programming, so a first run needs no download. Files are parsed with `ast`, never
imported, so nothing in the standard library runs.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from ember.atomic import write_atomic
from ember.data.errors import DataError

# Test suites hold thousands of throwaway docstrings; the IDLE tests live apart.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_LONGEST_ROW = 16 << 20  # far above any docstring's row


def stdlib_files(root: Path) -> list[Path]:
    """Every *.py file of the standard library at `root`, sorted, test folders left out."""
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts[:-1]
        if not _SKIP_DIRS.intersection(parts):
            files.append(path)
    return sorted(files)


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return None


def _docstrings(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def _topics(tree: ast.Module) -> Iterator[str]:
    """The values of `topics = {...}` in pydoc_data/topics.py: the language reference."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            try:
                topics = ast.literal_eval(node.value)
            except ValueError:
                return
            for key in sorted(topics):
                if isinstance(topics[key], str):
                    yield topics[key]


def _is_corpus(path: Path) -> bool:
    """Whether every line of `path` is a row as `write_stdlib_corpus` writes them."""
    with open(path, "rb") as handle:
        # Bounded reads, so a large file of something else is never held whole.
        for line in iter(lambda: handle.readline(_LONGEST_ROW), b""):
            if not line.endswith(b"\n"):
                return False
            try:
                row = json.loads(line)
            except ValueError:
                return False
            if not (isinstance(row, dict) and list(row) == ["text"] and isinstance(row["text"], str)):
                return False
    return True


def check_corpus_out(out_path: Path) -> None:
    """Refuse an output that would overwrite something the user made (a corpus written
    earlier may be replaced, so `make demo` can run again)."""
    if out_path.is_dir():
        raise DataError(f"--out {out_path} is a folder; name the JSON-lines file to write, "
                        f"e.g. {out_path / 'stdlib.jsonl'}.")
    if out_path.exists() and not _is_corpus(out_path):
        raise DataError(f"--out {out_path} already exists and is not a corpus ember wrote; "
                        "choose a new file name or remove it first.")


def write_stdlib_corpus(out_path: Path, min_chars: int = 40, root: Path | None = None) -> dict:
    """Write one JSON line `{"text": ...}` per standard-library docstring of at least
    `min_chars` characters; return {"documents", "characters", "files"}. `root` replaces
    this interpreter's standard library (for tests)."""
    out_path = Path(out_path)
    check_corpus_out(out_path)
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    counts = {"documents": 0, "characters": 0, "files": 0}

    def write(handle) -> None:
        for path in stdlib_files(root):
            tree = _parse(path)
            if tree is None:
                continue
            counts["files"] += 1
            texts = _docstrings(tree)
            if path.parent.name == "pydoc_data" and path.name == "topics.py":
                texts = _topics(tree)
            for text in texts:
                text = text.strip()
                if len(text) < min_chars:
                    continue
                handle.write((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8"))
                counts["documents"] += 1
                counts["characters"] += len(text)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out_path, write)
    return counts
