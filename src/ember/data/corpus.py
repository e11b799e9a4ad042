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

# Test suites hold thousands of throwaway docstrings; the IDLE tests live apart.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


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


def write_stdlib_corpus(out_path: Path, min_chars: int = 40, root: Path | None = None) -> dict:
    """Write one JSON line `{"text": ...}` per standard-library docstring of at least
    `min_chars` characters; return {"documents", "characters", "files"}. `root` replaces
    this interpreter's standard library (for tests)."""
    out_path = Path(out_path)
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
