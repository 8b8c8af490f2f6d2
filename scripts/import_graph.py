"""The runtime's import graph, measured from outside: floors, upward arrows, loops.

    python scripts/import_graph.py            # the four numbers for runtime/
    python scripts/import_graph.py --detail   # and what makes them: the arrows up, the loops

Read from the source with `ast` (nothing is imported, so no torch is needed). A node is one
file of the package (`dslaunch.runtime.zero.stage12`); an arrow is one module importing
another of the package. An import written at a module's top level (inside `try`/`if` too,
but not under `if TYPE_CHECKING:`) is a load-time arrow; one written inside a function is a
deferred arrow: it runs later, and it is the usual way to hide a loop.

Importing `a.b.c` runs a/__init__.py and a/b/__init__.py first, so an arrow to a.b.c is also
an arrow to every package __init__ above it that lies inside the measured package.

The four numbers:
- floors: the load-time graph of units, each loop squeezed to one node, stacked so that a
  unit stands one floor above the highest unit it imports (a unit that imports no other
  is floor 1). A unit is a package directly under the measured one (`zero/`), or one below
  a floor package (`core/comm/`, `train/checkpoint/`), or a single module beside them
  (`engine.py`, `core/strict.py`); every file rolls up to its unit. The package's own
  __init__ (the public face, which imports everything) is left out.
- upward arrows: arrows between units, load-time and deferred alike, that do not go down:
  a deferred import to a unit on the same floor or above (it would lift its importer if it
  ran at load time), and the arrows of a loop between units.
- cross-package loops: loops of the file graph, counting every import (deferred ones too:
  a loop that only closes at run time is still a loop), whose files lie in more than one
  package directory.
- hidden loops: deferred imports that close such a loop: an import inside a function from
  one package directory to another whose two ends lie in the same cross-package loop.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
FLOOR_PACKAGES = ("core", "train")  # packages whose children are the units


@dataclass
class Graph:
    package: str
    files: Dict[str, Path] = field(default_factory=dict)  # module name -> file
    load: Dict[str, Set[str]] = field(default_factory=lambda: defaultdict(set))
    deferred: Dict[str, Set[str]] = field(default_factory=lambda: defaultdict(set))

    def is_package(self, name: str) -> bool:
        return self.files[name].name == "__init__.py"


def module_name(path: Path, root: Path, package: str) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package] + parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> Iterable[Tuple[ast.stmt, bool]]:
    """(import statement, deferred?) for every import in the file."""
    def walk(node: ast.AST, deferred: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from walk_one(sub, deferred)
                continue
            yield from walk_one(child, deferred)

    def walk_one(child: ast.AST, deferred: bool):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, deferred
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from walk(child, True)
        else:
            yield from walk(child, deferred)

    yield from walk(tree, False)


def _resolve(graph: Graph, here: str, node: ast.stmt) -> List[str]:
    """The package's modules an import statement loads (the named module and the package
    __init__ files above it)."""
    targets: List[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        for name in names:
            targets.append(name)
    else:
        if node.level:
            base = here.split(".") if graph.is_package(here) else here.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        targets.append(origin)
        for alias in node.names:
            if f"{origin}.{alias.name}" in graph.files:  # `from pkg import submodule`
                targets.append(f"{origin}.{alias.name}")
    out: List[str] = []
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in graph.files and name != here and name != graph.package:
                out.append(name)
    return out


def build(root: Path, package: str) -> Graph:
    graph = Graph(package)
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        graph.files[module_name(path, root, package)] = path
    for name, path in graph.files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, deferred in _imports(tree):
            for target in _resolve(graph, name, node):
                # a child package's __init__ importing the parent's __init__ is not a real arrow
                if name.startswith(target + ".") and graph.is_package(target):
                    continue
                (graph.deferred if deferred else graph.load)[name].add(target)
    for name in graph.files:  # a deferred arrow that is also a load-time one is a load-time one
        graph.deferred[name] -= graph.load[name]
    return graph


def strongly_connected(nodes: Iterable[str], edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's algorithm, iterative."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    out: List[List[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                out.append(sorted(component))
    return out


def unit_of(graph: Graph, name: str) -> str:
    rel = name[len(graph.package) + 1:].split(".")
    depth = 2 if rel[0] in FLOOR_PACKAGES and len(rel) > 1 else 1
    return ".".join(rel[:depth])


def package_dir(graph: Graph, name: str) -> str:
    return name if graph.is_package(name) else name.rpartition(".")[0]


def floors(nodes: Iterable[str], edges: Dict[str, Set[str]]) -> Dict[str, int]:
    """Each node's floor: one above the highest floor it imports; a loop is one floor."""
    nodes = sorted(nodes)
    components = strongly_connected(nodes, edges)  # Tarjan emits components callee-first
    comp_of = {n: i for i, comp in enumerate(components) for n in comp}
    level: Dict[int, int] = {}
    for i, comp in enumerate(components):
        below = [level[comp_of[t]] for n in comp for t in edges.get(n, ()) if comp_of[t] != i]
        level[i] = 1 + max(below, default=0)
    return {n: level[comp_of[n]] for n in nodes}


@dataclass
class Measure:
    floors: int
    unit_floor: Dict[str, int]
    arrows: int
    upward: List[Tuple[str, str, str]]  # (from unit, to unit, "load"/"deferred")
    loops: List[List[str]]
    hidden: List[Tuple[str, str]]
    deferred_count: int


def measure(graph: Graph) -> Measure:
    # the package's own __init__ (the public face, which imports everything) and the floor
    # packages' (docstrings) are no units
    skip = {graph.package} | {f"{graph.package}.{f}" for f in FLOOR_PACKAGES}
    units = sorted({unit_of(graph, n) for n in graph.files if n not in skip})
    unit_load: Dict[str, Set[str]] = defaultdict(set)
    unit_deferred: Dict[str, Set[str]] = defaultdict(set)
    for kind, edges, into in (("load", graph.load, unit_load), ("deferred", graph.deferred, unit_deferred)):
        for src, targets in edges.items():
            if src in skip:
                continue
            for dst in targets:
                if dst in skip:
                    continue
                a, b = unit_of(graph, src), unit_of(graph, dst)
                if a != b:
                    into[a].add(b)
    for a in units:
        unit_deferred[a] -= unit_load[a]
    unit_floor = floors(units, unit_load)
    upward = []
    for kind, edges in (("load", unit_load), ("deferred", unit_deferred)):
        for a in units:
            for b in sorted(edges.get(a, ())):
                if unit_floor[b] >= unit_floor[a]:
                    upward.append((a, b, kind))
    arrows = sum(len(unit_load[a]) + len(unit_deferred[a]) for a in units)
    file_nodes = sorted(graph.files)
    every: Dict[str, Set[str]] = defaultdict(set)
    for edges in (graph.load, graph.deferred):
        for src, targets in edges.items():
            if src != graph.package:
                every[src] |= targets
    loops = [c for c in strongly_connected(file_nodes, every)
             if len(c) > 1 and len({package_dir(graph, n) for n in c}) > 1]
    loop_of = {n: i for i, c in enumerate(loops) for n in c}
    hidden = [(src, dst) for src in file_nodes for dst in sorted(graph.deferred.get(src, ()))
              if src != graph.package and package_dir(graph, src) != package_dir(graph, dst)
              and src in loop_of and loop_of[src] == loop_of.get(dst)]
    deferred_count = sum(len(v) for v in graph.deferred.values())
    return Measure(max(unit_floor.values(), default=0), unit_floor, arrows, upward, loops, hidden, deferred_count)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(ROOT / "runtime"), help="the package's folder (default: runtime/)")
    parser.add_argument("--package", default="dslaunch.runtime", help="its import name")
    parser.add_argument("--detail", action="store_true", help="list the floors, the arrows up and the loops")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not (root / "__init__.py").is_file():
        print(f"error: {root}: not a package folder (no __init__.py)", file=sys.stderr)
        return 2
    graph = build(root, args.package)
    m = measure(graph)
    print(f"floors: {m.floors}")
    print(f"upward arrows: {len(m.upward)} of {m.arrows}")
    print(f"cross-package loops: {len(m.loops)}")
    print(f"hidden loops: {len(m.hidden)} (deferred imports inside the package: {m.deferred_count})")
    if args.detail:
        by_floor: Dict[int, List[str]] = defaultdict(list)
        for unit, floor in m.unit_floor.items():
            by_floor[floor].append(unit)
        print("\nfloors, top first:")
        for floor in sorted(by_floor, reverse=True):
            print(f"  {floor}: {' '.join(sorted(by_floor[floor]))}")
        print("\narrows up:")
        for a, b, kind in m.upward:
            print(f"  {a} (floor {m.unit_floor[a]}) -> {b} (floor {m.unit_floor[b]}) [{kind}]")
        print("\ncross-package loops:")
        for loop in m.loops:
            dirs = {package_dir(graph, n) for n in loop}
            print(f"  {len(loop)} files in {len(dirs)} packages: {' '.join(n[len(graph.package) + 1:] for n in loop)}")
        print("\nhidden loops (a deferred import that closes a cross-package loop):")
        for src, dst in m.hidden:
            print(f"  {src[len(graph.package) + 1:]} -> {dst[len(graph.package) + 1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
