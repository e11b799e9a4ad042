"""ember's import graph, and the cycles in it: `python tests/import_graph.py` prints them.

Every `import` and `from ... import` in src/ember counts, including those inside
functions: an import deferred to run time still ties two modules together. Two graphs are
checked: modules ("ember.train.trainer"), and units (a subpackage such as "train", or a
top-level module such as "config"), so that one package reaching into another that reaches
back is found even when no two modules import each other.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_graph() -> dict[str, set[str]]:
    """Module -> the ember modules it imports (a package import counts as its __init__)."""
    files = {_module_name(p): p for p in (SRC / "ember").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                # The longest known module the target names ("ember.plan.comm" for
                # "from ember.plan import comm", "ember.plan" for "from ember.plan import X").
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("ember"):
                    graph[name].add(target)
    return graph


def unit(module: str) -> str:
    """"ember.train.trainer" -> "train"; "ember.config" -> "config"; "ember" -> "ember"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(unit(module), set())
        for target in targets:
            if unit(target) != unit(module) and unit(module) not in ("ember", "cli", "__main__"):
                units[unit(module)].add(unit(target))
    return units


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    graph = module_graph()
    bad = [("modules", c) for c in cycles(graph)] + [("packages", c) for c in cycles(unit_graph(graph))]
    for kind, component in bad:
        print(f"import cycle between {kind}: {' <-> '.join(component)}")
    if not bad:
        print(f"no import cycles among {len(graph)} modules")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
