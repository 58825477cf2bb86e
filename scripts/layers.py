"""Fail on an import cycle or an upward import inside the ``fabric`` package.

The package is layered, one way::

    fabric, errors, threads -> settings -> kv -> store -> transfer -> config ->
    {integrations, shared_store, router, testing} -> launch -> bench -> cli

A module may import its own package's modules and those of lower layers,
never a higher layer nor a sibling package of its own layer: every import
counts (module level, inside functions, under ``TYPE_CHECKING``). No two
modules may import each other, directly or through others, at run time
(an import under ``if TYPE_CHECKING:`` is for annotations only and makes
no cycle).

    python scripts/layers.py [ROOT]     # exit 1 and one line per finding
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

LAYERS: list[tuple[str, ...]] = [
    ("", "errors", "threads"),
    ("settings",),
    ("kv",),
    ("store",),
    ("transfer",),
    ("config",),
    ("integrations", "shared_store", "router", "testing"),
    ("launch",),
    ("bench",),
    ("cli", "__main__"),
]
"""Bottom to top: the part after ``fabric.`` of each module, by its first name."""


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root`` (the package)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


TYPE_CHECKING_TESTS = ("TYPE_CHECKING", "typing.TYPE_CHECKING")
"""The ``if`` tests whose body runs for type checkers only (``if not
TYPE_CHECKING:`` runs at run time: its imports make cycles)."""


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str, bool]]:
    """(line, module, typing only) of every import of a module in ``known`` by ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in TYPE_CHECKING_TESTS
        for inner in ast.walk(ast.Module(body=node.body, type_ignores=[]))
    }
    for node in ast.walk(tree):
        typed = id(node) in typing_only
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield node.lineno, alias.name, typed
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            yield from ((node.lineno, sub, typed) for sub in subs)
            if len(subs) < len(node.names) and base in known:
                yield node.lineno, base, typed


def layer(name: str) -> tuple[int, str]:
    """(layer index, top-level part) of a ``fabric...`` module (``""``: the package's own)."""
    parts = name.split(".")
    part = parts[1] if len(parts) > 1 else ""
    for index, names in enumerate(LAYERS):
        if part in names:
            return index, part
    raise SystemExit(f"{name}: not in any layer of scripts/layers.py")


def upward(graph: dict[str, dict[str, int]], known: dict[str, Path]) -> Iterator[str]:
    for source, targets in graph.items():
        here, part = layer(source)
        for target, line in targets.items():
            there, other = layer(target)
            if there > here or (there == here and other != part):
                where = "upward" if there > here else "sideways"
                yield f"{known[source]}:{line}: {where} import of {target}"


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def check(root: Path) -> list[str]:
    known = modules(root)
    graph: dict[str, dict[str, int]] = {name: {} for name in known}
    runtime: dict[str, dict[str, int]] = {name: {} for name in known}
    for name, path in known.items():
        for line, target, typed in imports(name, path, known):
            if target != name:
                graph[name].setdefault(target, line)
                if not typed:
                    runtime[name].setdefault(target, line)
    findings = list(upward(graph, known))
    findings += [f"import cycle: {' -> '.join(group)}" for group in cycles(runtime)]
    return findings


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).parents[1] / "fabric"
    findings = check(root)
    for finding in findings:
        print(finding)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
