"""The package's layers, read from its imports: ARCHITECTURE.md's table is the law, this test the judge.

The import graph of ``fusion`` and ``patterns`` is built from the source (``ast``, nothing
imported).  Every import counts, at module level and inside functions alike: an import put
off into a function still makes the module depend on the other one, it only hides the
circle from Python's loader.  An edge goes to the module an import names (``from
fusion.engine import rule`` -> ``fusion.engine.rule``; ``from fusion.ir.graph import Entry``
-> ``fusion.ir.graph``); the packages above it are not counted as dependencies, although
Python runs their ``__init__`` first: a package's ``__init__`` is a node with its own imports.

Checked:
* no import circle among modules (each named, module by module);
* every module belongs to a layer of ARCHITECTURE.md, and imports only the layers that
  layer's row allows (its own, and the ones listed);
* no module imports another module's private name (``from .x import _y``, ``x._y``), nor a
  private module (``_name.py``) of another package.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("fusion", "patterns")


def _modules() -> Dict[str, str]:
    """Dotted module name -> file, for every module of ``fusion`` and ``patterns``."""
    out = {}
    for top in TOP:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if os.path.exists(os.path.join(folder, d, "__init__.py")))
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = os.path.join(folder, f)
    return out


MODULES = _modules()


def _package(module: str, modules: Dict[str, str]) -> str:
    return module if modules[module].endswith("__init__.py") else module.rpartition(".")[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))




class _Imports(ast.NodeVisitor):
    """The project modules one module imports, and its uses of other modules' private names."""

    def __init__(self, module: str, modules: Dict[str, str] = MODULES, top: Tuple[str, ...] = TOP):
        self.module, self.modules, self.top = module, modules, top
        self.edges: Set[str] = set()
        self.private: List[str] = []
        self.aliases: Dict[str, str] = {}     # local name -> project module it is bound to

    def _known(self, dotted: str) -> Optional[str]:
        while dotted and dotted not in self.modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def _edge(self, target: str, line: int) -> None:
        if target == self.module:
            return
        self.edges.add(target)
        package, _, name = target.rpartition(".")
        if _is_private(name) and _package(self.module, self.modules) != package:
            self.private.append("%s:%d imports %s, a private module of another package" % (self.module, line, target))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] not in self.top:
                continue
            target = self._known(a.name)
            if target:
                self._edge(target, node.lineno)
                if a.asname:
                    self.aliases[a.asname] = target
                else:
                    self.aliases[a.name.split(".")[0]] = a.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = _package(self.module, self.modules).split(".")
            base = base[: len(base) - (node.level - 1)]
            dotted = ".".join(base + ([node.module] if node.module else []))
        else:
            dotted = node.module or ""
        if dotted.split(".")[0] not in self.top:
            return
        source = self._known(dotted)
        if source is None:
            return
        for a in node.names:
            if dotted + "." + a.name in self.modules:          # a module of a package
                target = dotted + "." + a.name
                self._edge(target, node.lineno)
                self.aliases[a.asname or a.name] = target
                continue
            self._edge(source, node.lineno)
            if _is_private(a.name):
                self.private.append("%s:%d imports %s from %s" % (self.module, node.lineno, a.name, source))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = []
        value: ast.AST = node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in self.aliases:
            dotted = self.aliases[value.id]
            for attr in reversed(chain):
                if dotted + "." + attr in self.modules:
                    dotted += "." + attr
                    continue
                if _is_private(attr) and dotted != self.module:
                    self.private.append("%s:%d uses %s.%s" % (self.module, node.lineno, dotted, attr))
                break
            return          # the inner attributes were walked here
        self.generic_visit(node)


def _graph() -> Tuple[Dict[str, Set[str]], List[str]]:
    edges, private = {}, []
    for module, path in MODULES.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        v = _Imports(module)
        v.visit(tree)
        edges[module] = v.edges
        private += v.private
    return edges, private


EDGES, PRIVATE = _graph()


# ---------------------------------------------------------------- the document's layers

def _layers() -> Dict[str, Tuple[str, Set[str]]]:
    """ARCHITECTURE.md's layer table: layer -> (path, layers it may import)."""
    with open(os.path.join(ROOT, "ARCHITECTURE.md")) as f:
        text = f.read()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\|\s*\*\*(\w+)\*\*\s*\|\s*`([^`]+)`\s*\|.*\|\s*([^|]*?)\s*\|\s*$", line)
        if m:
            may = {w.strip() for w in m.group(3).split(",") if w.strip() not in ("", "—", "-")}
            rows[m.group(1)] = (m.group(2), may)
    return rows


LAYERS = _layers()


def _layer_of(module: str) -> Optional[str]:
    """The layer whose path holds the module (the longest path that does)."""
    path = os.path.relpath(MODULES[module], ROOT).replace(os.sep, "/")
    best = None
    for layer, (where, _) in LAYERS.items():
        if path == where or (where.endswith("/") and path.startswith(where)):
            if best is None or len(where) > len(LAYERS[best][0]):
                best = layer
    return best


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle through each strongly connected group of modules (Tarjan), named module by module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    groups: List[List[str]] = []

    def connect(v: str) -> None:          # iterative: no recursion limit to meet
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        while work:
            node, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        group.append(w)
                        if w == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    circles = []
    for group in groups:        # the shortest circle through each module of the group, each circle once
        members = set(group)
        for start in group:
            circle = _shortest_circle(edges, members, start)
            turn = circle.index(min(circle[:-1]))
            circle = circle[turn:-1] + circle[:turn] + [circle[turn]]
            if circle not in circles:
                circles.append(circle)
    return circles


def _shortest_circle(edges: Dict[str, Set[str]], members: Set[str], start: str) -> List[str]:
    came_from: Dict[str, Optional[str]] = {start: None}
    frontier = [start]
    while frontier:             # breadth first, back to start
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("%s is in a strongly connected group but on no circle" % start)


# ---------------------------------------------------------------- the checks

def test_the_document_names_every_layer():
    assert LAYERS, "ARCHITECTURE.md has no layer table"
    for layer, (path, may) in LAYERS.items():
        assert os.path.exists(os.path.join(ROOT, path)), "ARCHITECTURE.md: layer %s's %s does not exist" % (layer, path)
        assert may <= set(LAYERS), "ARCHITECTURE.md: layer %s may import unknown layers %s" % (layer, may - set(LAYERS))
    homeless = sorted(m for m in MODULES if _layer_of(m) is None)
    assert not homeless, "modules in no layer of ARCHITECTURE.md: %s" % ", ".join(homeless)
    subpackages = sorted(m for m in MODULES if m.count(".") == 1 and MODULES[m].endswith("__init__.py"))
    undocumented = [m for m in subpackages if _layer_of(m) is None or LAYERS[_layer_of(m)][0].rstrip("/") !=
                    m.replace(".", "/")]
    assert not undocumented, "subpackages without their own row in ARCHITECTURE.md: %s" % ", ".join(undocumented)


def test_no_import_circles():
    circles = _cycles(EDGES)
    assert not circles, "import circles:\n" + "\n".join("  " + " -> ".join(c) for c in circles)


def test_layers_import_only_what_the_document_allows():
    wrong = []
    for module, targets in sorted(EDGES.items()):
        layer = _layer_of(module)
        for t in sorted(targets):
            other = _layer_of(t)
            if other != layer and other not in LAYERS[layer][1]:
                wrong.append("%s (%s) imports %s (%s)" % (module, layer, t, other))
    assert not wrong, "imports across layers that ARCHITECTURE.md does not allow:\n  " + "\n  ".join(wrong)


def test_no_private_names_across_modules():
    assert not PRIVATE, "private names used across modules:\n  " + "\n  ".join(PRIVATE)


def test_subpackages_say_what_lives_there_and_what_they_may_import():
    for module, path in MODULES.items():
        if module.count(".") != 1 or not path.endswith("__init__.py"):
            continue
        with open(path) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        assert "may import" in doc.lower(), "%s's docstring does not say what it may import" % module


@pytest.mark.parametrize("source, message", [
    ("from .b import _x\n", "imports _x from pkg.b"),
    ("from . import b\nb._x()\n", "uses pkg.b._x"),
    ("import pkg.b as bb\nbb._x\n", "uses pkg.b._x"),
    ("import pkg.b\npkg.b._x\n", "uses pkg.b._x"),
    ("from .sub import _m\n", "private module of another package"),
])
def test_private_use_is_caught(source, message):
    modules = {"pkg": "pkg/__init__.py", "pkg.a": "pkg/a.py", "pkg.b": "pkg/b.py",
               "pkg.sub": "pkg/sub/__init__.py", "pkg.sub._m": "pkg/sub/_m.py"}
    v = _Imports("pkg.a", modules, ("pkg",))
    v.visit(ast.parse(source))
    assert len(v.edges) == 1 and any(message in p for p in v.private), (v.edges, v.private)


def test_circles_are_found_and_named():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
