"""Whole-model tests: Gluon model-zoo CNNs with random weights and randomized BatchNorm stats.

For each network the Conv-BN family must fold every BatchNorm fed directly by a
Convolution/Deconvolution whose output nothing else uses, leave every other
BatchNorm alone (DenseNet's and ResNet v2's pre-activation BNs), report exactly
those folds, keep the outputs within 1e-4 relative, be idempotent, and leave the
caller's parameter dicts and arrays untouched.

Inputs are batch 1 and as small as each network allows (DenseNet and SqueezeNet
end in fixed 7×7 / 13×13 pools, Inception-v3 in an 8×8 pool).
"""
from __future__ import annotations

import json
from typing import Dict, List, Set, Tuple

import numpy as np
import pytest

import fusion
from fusion.testing import zoo_model
from patterns import rules_by_name

RTOL = 1e-4
CONV_OPS = ("Convolution", "Deconvolution")

MODELS = [
    ("resnet18_v1", 64),
    ("resnet18_v2", 64),
    ("resnet50_v1", 64),        # bottleneck blocks
    ("mobilenet0.25", 64),
    ("mobilenetv2_0.25", 64),
    ("densenet121", 224),        # ends in a 7×7 average pool
    ("inceptionv3", 299),        # ends in an 8×8 average pool
    ("squeezenet1.0", 224),      # ends in a 13×13 average pool; no BatchNorm at all
    ("vgg11_bn", 64),
]


def _graph(symbol) -> Tuple[List[dict], List[list]]:
    data = json.loads(symbol.tojson())
    return data["nodes"], data["heads"]


def _use_counts(nodes: List[dict], heads: List[list]) -> Dict[int, int]:
    uses: Dict[int, int] = {}
    for nd in nodes:
        for src, _, *_ in nd.get("inputs", []):
            uses[src] = uses.get(src, 0) + 1
    for src, _, *_ in heads:
        uses[src] = uses.get(src, 0) + 1
    return uses


def conv_fed_batchnorms(symbol) -> Tuple[Set[str], Set[str]]:
    """(names of BatchNorms fed by a conv used only by them, names of all other BatchNorms)."""
    nodes, heads = _graph(symbol)
    uses = _use_counts(nodes, heads)
    foldable, other = set(), set()
    for nd in nodes:
        if nd["op"] != "BatchNorm":
            continue
        src = nd["inputs"][0][0]
        if nodes[src]["op"] in CONV_OPS and uses[src] == 1:
            foldable.add(nd["name"])
        else:
            other.add(nd["name"])
    return foldable, other


def batchnorms_after_conv(symbol) -> List[str]:
    """BatchNorms reading a convolution that nothing else reads (a convolution read elsewhere too,
    e.g. DenseNet's transition once it pools first, cannot take the BatchNorm in)."""
    nodes, _ = _graph(symbol)
    readers: Dict[int, int] = {}
    for nd in nodes:
        for e in nd.get("inputs", ()):
            readers[e[0]] = readers.get(e[0], 0) + 1
    return [nd["name"] for nd in nodes
            if nd["op"] == "BatchNorm" and nodes[nd["inputs"][0][0]]["op"] in CONV_OPS
            and readers[nd["inputs"][0][0]] == 1]


def op_names(symbol, op: str) -> Set[str]:
    nodes, _ = _graph(symbol)
    return {nd["name"] for nd in nodes if nd["op"] == op}


def matched_names(report, rule_names: Set[str]) -> List[str]:
    """Names of all nodes inside the matches fused by ``rule_names`` (with repeats, to catch double folds)."""
    return [n for name, r in report.rules.items() if name in rule_names for m in r.fused for n in m["nodes"]]


def _snapshot(arg: dict, aux: dict, names: List[str]) -> Dict[str, np.ndarray]:
    return {n: (arg.get(n, aux.get(n))).asnumpy().copy() for n in names}


@pytest.fixture(scope="module")
def conv_bn_rules() -> Set[str]:
    return {r.name for r in rules_by_name()["bn_folding"]}


@pytest.mark.parametrize("name,size", MODELS, ids=[m[0] for m in MODELS])
def test_zoo_model(name, size, conv_bn_rules):
    shape = (1, 3, size, size)
    sym, arg, aux = zoo_model(name, shape, seed=0)
    foldable, other = conv_fed_batchnorms(sym)

    # The arrays a fold reads (conv weights and BN parameters/statistics) of a few pairs, before fusing.
    nodes, _ = _graph(sym)
    by_name = {nd["name"]: nd for nd in nodes}
    watched: List[str] = []
    for bn in sorted(foldable)[:3]:
        conv = nodes[by_name[bn]["inputs"][0][0]]
        watched += [nodes[e[0]]["name"] for e in conv["inputs"][1:] + by_name[bn]["inputs"][1:]]
    watched = [n for n in watched if n in arg or n in aux]
    before = _snapshot(arg, aux, watched)
    arg_keys, aux_keys = set(arg), set(aux)
    arg_ids = {k: id(v) for k, v in arg.items()}

    result = fusion.fuse(sym, arg, aux)

    # Caller's params untouched: same keys, same objects, same values.
    assert set(arg) == arg_keys and set(aux) == aux_keys
    assert {k: id(v) for k, v in arg.items()} == arg_ids
    after = _snapshot(arg, aux, watched)
    for n in watched:
        np.testing.assert_array_equal(after[n], before[n], err_msg="caller's array '%s' was modified" % n)

    # Every conv-fed BatchNorm folded, no other BatchNorm touched by the Conv-BN family.
    assert batchnorms_after_conv(result.symbol) == []
    left = op_names(result.symbol, "BatchNorm")
    assert not (left & foldable), "conv-fed BatchNorms left unfolded: %s" % sorted(left & foldable)[:5]
    folded = [n for n in matched_names(result.report, conv_bn_rules) if n in foldable | other]
    assert sorted(folded) == sorted(foldable), "report's Conv-BN folds differ from the conv-fed BatchNorms"
    others_fused = set(matched_names(result.report, set(result.report.rules) - conv_bn_rules))
    missing = other - left - others_fused
    assert not missing, "BatchNorms not after a conv disappeared: %s" % sorted(missing)[:5]
    if name == "densenet121":
        assert len(other) > 0  # its pre-activation BNs (transition layers, dense layers' first BN)
    if name == "resnet18_v2":
        assert len(other) > 0

    # Same outputs.
    v = fusion.verify((sym, arg, aux), result, input_shapes={"data": shape})
    assert v.max_rel <= RTOL, "%s: %s" % (name, v)

    # Idempotent.
    again = fusion.fuse(result.symbol, result.arg_params, result.aux_params)
    assert again.symbol.tojson() == result.symbol.tojson()
