"""The rule library: one module per fusion family, each exporting ``RULES``.

``default_rules()`` is what ``fusion.fuse`` uses when no rules are given;
``rules_by_name()`` maps rule names and family (module) names to rules, for
``fuse(..., rules=["conv_bn_act"])`` and ``mxfuse --rules``.
"""
from __future__ import annotations

import importlib
from typing import Dict, List

FAMILIES = ("constant_fold", "attention", "dense_act", "skip_layer_norm", "conv_bn_act", "layer_norm", "gelu", "softmax", "elementwise")


def _family(name: str) -> List:
    return list(importlib.import_module("patterns." + name).RULES)


def default_rules() -> List:
    return [r for fam in FAMILIES for r in _family(fam)]


def rules_by_name() -> Dict[str, List]:
    out: Dict[str, List] = {}
    for fam in FAMILIES:
        rules = _family(fam)
        out[fam] = rules
        for r in rules:
            out.setdefault(r.name, [r])
    return out
