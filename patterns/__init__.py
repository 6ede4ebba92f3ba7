"""The rule library: one module per fusion family, each exporting ``RULES``.

``default_rules()`` is what ``fusion.fuse`` uses when no rules are given;
``rules_by_name()`` maps rule names and family names to rules, for
``fuse(..., rules=["conv_bn"])`` and ``mxfuse --rules``; ``rule_table()``
is what ``mxfuse --list-rules`` prints.

A family and a rule never share a name, so a name in ``--rules`` means one
thing: a module of several variants is a family with a name of its own
(``bn_folding``: ``conv_bn_add_act``, ``conv_bn_act``, ``conv_bn``, ``dense_bn``);
a module of one rule is that rule alone.
"""
from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Tuple

#: The modules of the library, in the order their rules are listed.
MODULES = ("constant_fold", "pad_conv", "attention", "squeeze_excitation", "split_attention", "dense_act", "skip_layer_norm",
           "conv_bn_act", "layer_norm", "gelu", "softmax", "elementwise", "qkv_projection",
           "inverted_residual", "dense_block", "region", "box_nms", "max_pool", "roi_align", "bilinear_resize")

#: Modules whose rules run only when asked for by name (``--rules dense_concat``): exact, but
#: measured slower under MXNet's default bind -- its oneDNN ops keep DenseNet's feature maps in
#: blocked layouts, and every piece a library op reads is reordered to NCHW for it
#: (benchmarks/bench_cnn_blocks.py, DenseNet-121).  ``grouped_convolution`` likewise: in ResNeXt's block,
#: with the reorders from and to MXNet's layouts, oneDNN 3.x's grouped convolution measured
#: 0.76-0.99x of MXNet's own (benchmarks/bench_grouped_conv.py).
#: ``deconvolution`` likewise: oneDNN 3.x's transposed convolution measured 1.14-1.46x of MXNet's at
#: one thread, but at parity or slower at two on the shared 2-core machines once the reorders around
#: it are paid (tools/measure_cpu_costs.py); it is also gated by the CPU's cost table (fusion/engine/cost.py).
OPT_IN = ("concat_bn_act", "grouped_conv", "deconv_act")

#: Family name -> the module whose rules it groups (modules of a single rule form no family).
FAMILIES: Dict[str, str] = {
    "inference_cleanup": "constant_fold",
    "attention_fusion": "attention",
    "bn_folding": "conv_bn_act",
    "gelu": "gelu",
    "squeeze_excitation": "squeeze_excitation",
    "split_attention": "split_attention",
    "grouped_convolution": "grouped_conv",
    "dense_concat": "concat_bn_act",
    "densenet": "dense_block",
    "deconvolution": "deconv_act",
}


def _module_rules(module: str) -> List:
    return list(importlib.import_module("patterns." + module).RULES)


def default_rules() -> List:
    return [r for module in MODULES for r in _module_rules(module)]


def rules_by_name() -> Dict[str, List]:
    out: Dict[str, List] = {}
    for module in MODULES + OPT_IN:
        for r in _module_rules(module):
            out[r.name] = [r]
    for family, module in FAMILIES.items():
        assert family not in out, "family %r shares its name with a rule" % family
        out[family] = _module_rules(module)
    return out


def family_of(rule_name: str) -> Optional[str]:
    for family, module in FAMILIES.items():
        if any(r.name == rule_name for r in _module_rules(module)):
            return family
    return None


def rule_table() -> List[Tuple[str, str, str, str]]:
    """(rule, family or "-", "inference only" or "inference and training", what it matches) per rule."""
    return [(r.name, family_of(r.name) or "-",
             "inference only" if r.inference_only else "inference and training", r.description)
            for r in default_rules()]
