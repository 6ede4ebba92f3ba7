"""Rewrite imports of fusion/'s former flat modules to the layered layout (ARCHITECTURE.md).

    python tools/migrate_imports.py [PATH ...]      # default: fusion patterns tests tools benchmarks examples cuda_kernels

For code written against the flat layout (``from .precision import is_bf16`` in a module of
fusion/, ``from fusion.graph import Entry`` anywhere): each import of a module that moved is
respelled with its new path; imports that already name an existing module are left as they are,
so a file half converted (a merge) comes out whole, and a second run changes nothing.  Names
that moved between modules or were renamed (``MOVED_NAMES``) are respelled in imports only; their
uses in the code still need a look (a renamed name is imported under its old name, so the code
runs; tests/test_architecture.py then names the private ones).  In fusion/onnx/, ``.graph`` meant
the graph IR before and is the ONNX graph view now: an import of names the view does not define is
read as the IR, and named on stderr.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# former module (fusion.X) -> its module now
MODULES: Dict[str, str] = {}
for package, mods in {"native": {"_env": "env", "_native": "library", "build": "build"},
                      "ir": {m: m for m in ("errors", "attrs", "opdefs", "graph", "names", "pattern", "matcher")},
                      "precision": {"precision": "policy"},
                      "engine": {m: m for m in ("facts", "selfcheck", "rewrite", "rule", "report", "workarounds")},
                      "files": {"modelio": "modelio", "publish": "publish"},
                      "check": {"verify": "verify", "bench": "bench"},
                      "onnx": {"onnx_io": "importer", "onnx_export": "export", "onnx_passes": "passes",
                               "onnx_graph": "graph"},
                      "doors": {m: m for m in ("cli", "batch", "backend", "serving", "html_report", "progress",
                                               "about", "argtypes")},
                      "testing": {"testing_gluoncv": "gluoncv"}}.items():
    for old, new in mods.items():
        MODULES["fusion." + old] = "fusion.%s.%s" % (package, new)

# (module now, name as imported before) -> (module it lives in now, its name now)
MOVED_NAMES: Dict[Tuple[str, str], Tuple[str, str]] = {
    ("fusion", "__version__"): ("fusion.version", "__version__"),
    ("fusion.check.bench", "subgraph_backend"): ("fusion.native.env", "subgraph_backend"),
    ("fusion.check.bench", "benchmark_lines"): ("fusion.engine.report", "benchmark_lines"),
    ("fusion.check.bench", "warn"): ("fusion.doors.progress", "benchmark_warnings"),
    ("fusion.doors.about", "versions"): ("fusion.version", "versions"),
    ("fusion.files.modelio", "PARAM_DTYPES"): ("fusion.precision.policy", "PARAM_DTYPES"),
    ("fusion.ir.graph", "_first_line"): ("fusion.ir.graph", "first_line"),
    ("fusion.ir.matcher", "_State"): ("fusion.ir.matcher", "State"),
    ("fusion.engine.selfcheck", "SHAPE_ONLY"): ("fusion.engine.inputs", "SHAPE_ONLY"),
    ("fusion.engine.selfcheck", "_PASS_THROUGH"): ("fusion.engine.inputs", "PASS_THROUGH"),
    ("fusion.engine.selfcheck", "_softmax_length_bound"): ("fusion.engine.inputs", "softmax_length_bound"),
    ("fusion.engine.selfcheck", "_attention_keys"): ("fusion.engine.inputs", "attention_keys"),
    ("fusion.engine.selfcheck", "_domain"): ("fusion.engine.inputs", "slot_domain"),
    ("fusion.engine.selfcheck", "_input_domain"): ("fusion.engine.inputs", "input_domain"),
    ("fusion.engine.selfcheck", "_draw"): ("fusion.engine.inputs", "draw"),
    ("fusion.engine.selfcheck", "_misread_nodes"): ("fusion.engine.selfcheck", "misread_nodes"),
    ("fusion.engine.facts", "_SIZE_KEEPING"): ("fusion.engine.facts", "SIZE_KEEPING"),
    ("fusion.api", "_fuse_gc_off"): ("fusion.api", "fuse_gc_off"),
    ("fusion.api", "_check_device_precision"): ("fusion.api", "check_device_precision"),
    ("fusion.doors.batch", "BATCH_HELP"): ("fusion.doors.batch_options", "BATCH_HELP"),
    ("fusion.doors.batch", "VERBOSE_HELP"): ("fusion.doors.batch_options", "VERBOSE_HELP"),
    ("fusion.doors.batch", "add_batch_arguments"): ("fusion.doors.batch_options", "add_batch_arguments"),
    ("fusion.doors.batch", "batch_only_flags"): ("fusion.doors.batch_options", "batch_only_flags"),
    ("patterns.unfuse_elemwise", "_parse"): ("fusion.ir.expr", "parse_expr"),
    ("patterns.unfuse", "_activation"): ("patterns._unfuse_ops", "activation"),
    ("patterns.unfuse", "_is_bf16_value"): ("patterns._unfuse_ops", "is_bf16_value"),
    ("patterns._unfuse_base", "_Unfuse"): ("patterns._unfuse_base", "UnfuseRule"),
    ("patterns.elementwise", "_batchnorm_scale_shift"): ("patterns.elementwise", "batchnorm_scale_shift"),
    ("patterns.layer_norm", "_axis"): ("patterns.layer_norm", "reduced_axis"),
    ("patterns.squeeze_excitation", "_pool"): ("patterns.squeeze_excitation", "average_pool"),
    ("patterns.squeeze_excitation", "_same"): ("patterns.squeeze_excitation", "same_shapes"),
}

FROM = re.compile(r"^(?P<indent>[ \t]*)from (?P<mod>\.+[\w.]*|(?:fusion|patterns)(?:\.[\w.]+)?) import "
                  r"(?P<names>\([^)]*\)|[^\n#]*?)(?P<tail>[ \t]*(?:#[^\n]*)?)$", re.M)
IN_STRING = re.compile(r"(?<=[\"'])from (fusion\.[\w.]+) import")
PLAIN = re.compile(r"\bimport (fusion\.\w+)\b")


def _exists(dotted: str) -> bool:
    path = os.path.join(ROOT, *dotted.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def _source(dotted: str) -> str:
    with open(os.path.join(ROOT, *dotted.split(".")) + ".py") as f:
        return f.read()


def _now(dotted: str) -> str:
    """The module ``dotted`` names today."""
    if dotted in MODULES:                   # a former module (fusion.precision is a package now)
        return MODULES[dotted]
    if _exists(dotted):
        return dotted
    for old, new in MODULES.items():
        if dotted.startswith(old + "."):
            return new + dotted[len(old):]
    return dotted


def _relative(target: str, package: str) -> str:
    up, base = 1, package
    while not (target == base or target.startswith(base + ".")):
        base, up = base.rpartition(".")[0], up + 1
    return "." * up + target[len(base) + 1:]


def _names(text: str) -> List[Tuple[str, Optional[str]]]:
    text = text.strip()
    if text.startswith("("):
        text = text[1:-1]
    out = []
    for part in text.replace("\n", " ").split(","):
        bits = part.split()
        if bits:
            out.append((bits[0], bits[2] if len(bits) == 3 else None))
    return out


def convert(text: str, package: Optional[str], path: str = "") -> str:
    """``package``: the package of the file (for its relative imports), None outside fusion/ and patterns/."""

    def fix(m: "re.Match") -> str:
        indent, mod, tail = m.group("indent"), m.group("mod"), m.group("tail")
        relative = mod.startswith(".")
        if relative:
            if package is None:
                return m.group(0)
            level = len(mod) - len(mod.lstrip("."))
            rest = mod[level:]
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - (level - 1)] + ([rest] if rest else []))
            if level == 1 and package.startswith("fusion.") and (not _exists(base) or base in MODULES):
                base = "fusion" + ("." + rest if rest else "")       # written for the flat layout
            if package == "fusion.onnx" and level == 1 and rest == "graph" and not all(
                    re.search(r"^(class|def) %s\b|^%s = " % (n, n), _source("fusion.onnx.graph"), re.M)
                    for n, _ in _names(m.group("names"))):
                base = "fusion.graph"       # the flat layout's graph IR, not the ONNX graph view
                print("%s: '.graph' read as the graph IR (fusion/ir/graph.py): check" % path, file=sys.stderr)
        else:
            base = mod
        names = _names(m.group("names"))
        groups: Dict[str, list] = {}
        for name, alias in names:
            base_of_name = base
            if (relative and package.startswith("fusion.") and mod == "." and not _exists(base + "." + name)
                    and ("fusion." + name in MODULES or ("fusion", name) in MOVED_NAMES)):
                base_of_name = "fusion"             # `from . import precision` written for the flat layout
            if base_of_name + "." + name in MODULES or _exists(base_of_name + "." + name):
                source, _, leaf = _now(base_of_name + "." + name).rpartition(".")
                item = (leaf, alias or (name if leaf != name else None))
            else:
                source, new_name = MOVED_NAMES.get((_now(base_of_name), name), (_now(base_of_name), name))
                item = (new_name, alias or (name if new_name != name else None))
            groups.setdefault(source, []).append(item)
        spelled = {s: _relative(s, package) if relative else s for s in groups}
        if len(groups) == 1 and list(spelled.values())[0] == mod and list(groups.values())[0] == names:
            return m.group(0)                   # already right: left as written
        return "\n".join("%sfrom %s import %s%s" % (indent, spelled[s], ", ".join(
            n if a is None else "%s as %s" % (n, a) for n, a in items), tail if i == 0 else "")
            for i, (s, items) in enumerate(groups.items()))

    text = FROM.sub(fix, text)
    text = IN_STRING.sub(lambda m: "from %s import" % _now(m.group(1)), text)
    return PLAIN.sub(lambda m: "import " + _now(m.group(1)), text)


def _package_of(path: str) -> Optional[str]:
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    parts = rel[:-3].split(os.sep)
    if parts[0] not in ("fusion", "patterns"):
        return None
    return ".".join(parts[:-1] if parts[-1] != "__init__" else parts[:-1])


def main(argv: List[str]) -> int:
    paths = argv or [os.path.join(ROOT, d) for d in
                     ("fusion", "patterns", "tests", "tools", "benchmarks", "examples", "cuda_kernels")]
    for top in paths:
        files = [top] if top.endswith(".py") else [os.path.join(f, n) for f, _, ns in os.walk(top) for n in ns
                                                    if n.endswith(".py")]
        for path in sorted(files):
            with open(path) as f:
                text = f.read()
            new = convert(text, _package_of(path), path)
            if new != text:
                with open(path, "w") as f:
                    f.write(new)
                print("rewrote", os.path.relpath(path, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
