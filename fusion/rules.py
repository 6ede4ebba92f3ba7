"""The public API for rule authors: the pattern DSL, the rule base and what a rewrite builds with.

Write a rule against this module only; the modules it gathers from (``fusion.ir``, ``fusion.engine``)
are the project's internals and may move, this module's names will not (a name that moves is
re-exported here and deprecated before it goes)::

    from fusion.rules import Const, Rule, Var, op, scalar

    class FoldScale(Rule):
        name = "fold_scale"
        benefit = 5                                   # larger patterns: larger benefit, run first

        def pattern(self):
            return scalar("mul", op.FullyConnected(Var("x"), Const("w"), name="fc"), name="s")

        def check(self, m):                           # None accepts; else a reason a user can read
            if m.value("w") is None:
                return "needs the value of the FullyConnected weight (pass params)"

        def rewrite(self, m, b):                      # the value that replaces the anchor's output
            w = b.param(m.node("fc").name + "_scaled_weight", m.value("w") * m.node("s").attrs["scalar"])
            return b.op("FullyConnected", [m["x"], w], attrs=m.node("fc").attrs)

    RULES = [FoldScale()]

and use it with ``fusion.fuse(sym, arg, aux, rules=["default", "my_rules:RULES"])`` or
``mxfuse … --rules default,my_rules:RULES``.  ``docs/rules.md`` describes the DSL in full.

Rule modules written before this module existed import the DSL from ``fusion.pattern`` (and
``fusion.rule``, ``fusion.matcher``, ``fusion.graph``, ``fusion.rewrite``, ``fusion.errors``, the
package's former flat layout): those paths keep working, with a ``DeprecationWarning`` naming
the import to write instead.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Dict, Optional

from .engine.reasons import NearMiss, NeedsShapes
from .engine.rewrite import Builder
from .engine.rule import Rule
from .ir.errors import FusionError
from .ir.graph import Entry, Graph, Node
from .ir.matcher import Match
from .ir.pattern import AnyOf, Chain, Const, OneOf, Pattern, Region, Var, op, scalar

__all__ = ["Rule", "Pattern", "Var", "Const", "OneOf", "AnyOf", "op", "scalar", "Chain", "Region", "Match",
           "Builder", "Entry", "Node", "Graph", "NearMiss", "NeedsShapes", "FusionError"]

#: Former module paths of the rule-writing API -> the module they are now.  Importing one gives that
#: module itself (so ``from fusion.pattern import Var`` is this module's ``Var``), with a warning.
DEPRECATED_PATHS: Dict[str, str] = {
    "fusion.pattern": "fusion.ir.pattern",
    "fusion.matcher": "fusion.ir.matcher",
    "fusion.graph": "fusion.ir.graph",
    "fusion.errors": "fusion.ir.errors",
    "fusion.rule": "fusion.engine.rule",
    "fusion.rewrite": "fusion.engine.rewrite",
}


class _DeprecatedPath(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the paths of DEPRECATED_PATHS to the modules they moved to, warning once per import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in DEPRECATED_PATHS:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(DEPRECATED_PATHS[spec.name])

    def exec_module(self, module):
        old = next(k for k, v in DEPRECATED_PATHS.items() if v == module.__name__)     # the paths map 1:1
        warnings.warn("%s moved: import the rule-writing API from fusion.rules (%s is kept for rule modules "
                      "written before, as %s; it will go in a later release)" % (old, old, module.__name__),
                      DeprecationWarning, stacklevel=2)   # the import statement (warnings skips importlib's frames)


_FINDER: Optional[_DeprecatedPath] = None


def install_deprecated_paths() -> None:
    """Make the former paths importable (``import fusion`` does this)."""
    global _FINDER
    if _FINDER is None:
        _FINDER = _DeprecatedPath()
        sys.meta_path.append(_FINDER)
