"""Keep fused graphs clear of a miscomputation in MXNet 1.9.1's oneDNN subgraph backend.

At bind, MXNet's default ("MKLDNN") subgraph backend fuses a FullyConnected or a
Convolution with the elementwise op that reads it.  When the layer's output is also
read elsewhere, MXNet 1.9.1 can hand a reader the wrong value (measured with the pip
wheel, subgraph backend on vs off):

* FullyConnected read by an op the backend fuses into it and by anything else (a graph
  output, a second activation, another layer — depending on the order of the readers):
  ``Group([relu(fc), fc])`` returns ``relu(fc)`` twice, ``Group([relu(fc), tanh(fc)])``
  returns ``tanh(relu(fc))``, ``Group([fc2(fc), relu(fc)])`` a wrong ``relu(fc)``;
* Convolution read by such an op and also a graph output (either order);
* Convolution read by a BatchNorm with ``output_mean_var=True`` whose mean or variance is read
  (or is a graph output): the pass folds the BatchNorm into the convolution and hands out the
  folded convolution's output as the mean and the variance too (``Group([bn[0], bn[2]])`` gives a
  (N, C, H, W) array for the (C,) variance, measured);
* a member of that chain read twice by one add, ``elemwise_add(conv, conv)`` (what ``unfuse``
  writes for ``broadcast_add(x, x)``): the pass fuses the add as a sum into the convolution and
  the bind fails ("Shape inconsistent", measured); the add's second operand is guarded;
* more generally, a member of the chain its convolution pass fuses -- Convolution →
  [BatchNorm] → [elemwise_add] → [activation] -- that is a graph output while the chain goes
  on past it: ``Group([relu(bn(conv)), bn(conv)])`` returns ``relu(bn(conv))`` twice, and so
  do an add after a Convolution or its BatchNorm (each measured 2.8–7.7 off).  A chain member
  read by another *op* is seen by the pass (the chain stops there); a graph output is not.

MXNet 1.9.1's oneDNN ("MKLDNN") backend registers five passes: convolution (the chain above),
FullyConnected (with one activation or elementwise op: its selector keeps every reader of the
layer as one of the fused op's, hence the FullyConnected rule above), BatchNorm → relu, and
GluonNLP's interleaved self-attention products (single ops: nothing read from inside).  BatchNorm
→ relu with the BatchNorm also an output, or read by another op, measured right.

A rewrite can create that shape where the original graph did not have it (GELU
written out after a FullyConnected becomes ``LeakyReLU(gelu)``; a folded BatchNorm
puts the activation right after the convolution).  So after fusion, a layer output
that is read more than once, by at least one op the backend fuses into the layer,
reaches that op through ``Reshape(x, shape=(-2,))`` — the identity for every rank
(code −2 copies all remaining dimensions), which the backend does not fuse into the
layer, so every reader gets the value the graph says.  The same holds for the graphs
``unfuse`` writes, and :func:`backend_hazards` names the places where a graph as given
(a user's model) would be miscomputed, for the report.
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple

from ..ir.graph import Entry, Graph, Node

# (layer op) -> ops MXNet 1.9.1's oneDNN backend fuses after it (measured with the pip wheel).
FUSED_AFTER: Dict[str, frozenset] = {
    "FullyConnected": frozenset({"Activation", "LeakyReLU", "square", "sqrt", "exp", "abs", "clip"}),
    "Convolution": frozenset({"Activation", "LeakyReLU", "clip", "elemwise_add", "BatchNorm"}),
}


# A member of the chain MXNet 1.9.1's convolution pass fuses (Convolution -> [BatchNorm] ->
# [elemwise_add] -> [Activation / LeakyReLU / clip]) -> ops that continue the chain after it.
_ACTS = frozenset({"Activation", "LeakyReLU", "clip"})
CONV_CHAIN_NEXT: Dict[str, frozenset] = {
    "Convolution": FUSED_AFTER["Convolution"] | {"_npi_add"},
    "BatchNorm": frozenset({"elemwise_add", "_npi_add"}) | _ACTS,
    "elemwise_add": _ACTS,
    "_npi_add": _ACTS,
}


def _in_conv_chain(nd: Node) -> bool:
    """Whether the convolution pass can take ``nd`` into a Convolution's chain: the Convolution, a
    BatchNorm of its output, an add of either."""
    if nd.op == "Convolution":
        return True
    if nd.op == "BatchNorm":
        return bool(nd.inputs) and nd.inputs[0].node.op == "Convolution" and nd.inputs[0].index == 0
    if nd.op in ("elemwise_add", "_npi_add"):
        return any(e.index == 0 and (e.node.op == "Convolution" or (e.node.op == "BatchNorm" and _in_conv_chain(e.node)))
                   for e in nd.inputs)
    return False


def _statistics_read(bn: Node, users, heads: Dict[Entry, int]) -> bool:
    """Whether ``bn`` is a BatchNorm returning its mean and variance with either read or an output."""
    if bn.op != "BatchNorm" or not bn.param("output_mean_var", False):
        return False
    return (any(u.inputs[slot].index in (1, 2) for u, slot in users.get(bn, ()))
            or any(e.node is bn and e.index in (1, 2) for e in heads))


def _hazards(graph: Graph) -> List[Tuple[Node, List[Tuple[Node, int]]]]:
    """(node, the readers MXNet's backend would fuse into it) for each node whose other uses the
    default bind would hand a wrong value: the FullyConnected and conv-chain cases above."""
    users = graph.consumers()
    heads: Dict[Entry, int] = {}
    for e in graph.heads:
        heads[e] = heads.get(e, 0) + 1
    found = []
    for nd in graph.nodes:
        if nd.op == "FullyConnected":
            fused_ops = FUSED_AFTER["FullyConnected"]
        elif nd.op in CONV_CHAIN_NEXT and _in_conv_chain(nd):
            fused_ops = CONV_CHAIN_NEXT[nd.op]
        else:
            continue
        readers = [(u, slot) for u, slot in users.get(nd, ()) if u.inputs[slot].index == 0]
        fusable = [(u, slot) for u, slot in readers if u.op in fused_ops]
        guard: List[Tuple[Node, int]] = []
        if nd.op == "Convolution":      # a BatchNorm whose statistics are read
            guard += [(u, slot) for u, slot in fusable if slot == 0 and _statistics_read(u, users, heads)]
        if "elemwise_add" in fused_ops:  # an add of the value with itself: its second operand
            guard += [(u, 1) for u, slot in readers if slot == 0 and u.op in ("elemwise_add", "_npi_add")
                      and len(u.inputs) == 2 and u.inputs[1] == u.inputs[0]]
        # a _copy (what keeps a graph output's name where a rewrite replaced its node) hands out the
        # layer's output as a graph output does: measured, Group([sigmoid(conv), _copy(conv)]) gives
        # _copy the sigmoid's value too
        as_head = heads.get(Entry(nd), 0) + sum(1 for u, _ in readers if u.op == "_copy")
        if fusable and len(readers) + as_head >= 2 and (nd.op == "FullyConnected" or as_head):
            guard += [r for r in fusable if r not in guard]
        if guard:
            found.append((nd, guard))
    return found


def backend_hazards(graph: Graph) -> List[str]:
    """Where MXNet 1.9.1's default bind would miscompute ``graph`` as it is: "node -> reader" for each
    layer output also handed out elsewhere while the backend fuses a reader into it."""
    return ["%s -> %s" % (nd.name, u.name) for nd, fusable in _hazards(graph) for u, _ in fusable]


def _is_guard(nd: Node) -> bool:
    return nd.op == "Reshape" and nd.attrs.get("shape") == (-2,) and not nd.param("reverse", False)


def strip_guards(graph: Graph) -> None:
    """Remove identity ``Reshape(shape=(-2,))`` nodes (in place), so that rules see the graph as
    written; ``guard_layer_outputs`` puts back those still needed."""
    heads = set(graph.heads)
    if not any(_is_guard(nd) for nd in graph.nodes):
        return
    target = {}
    for nd in graph.nodes:
        if _is_guard(nd) and Entry(nd) not in heads:      # a graph output keeps its name
            src = nd.inputs[0]
            target[Entry(nd)] = target.get(src, src)
    for nd in graph.nodes:
        nd.inputs = [target.get(e, e) for e in nd.inputs]
    graph.heads = [target.get(e, e) for e in graph.heads]
    graph.mark_changed()
    graph.compact()


def _insert_guards(graph: Graph, reads: List[Tuple[Node, Node, int]]) -> None:
    """Each (layer, reader, slot): the reader's input ``slot`` reads the layer through an identity
    ``Reshape(shape=(-2,))`` placed just before the reader (in place)."""
    added: List[Node] = []
    names = {n.name for n in graph.nodes}
    for nd, u, slot in reads:
        guard = Node("Reshape", graph.unique_name(u.name + "_guard", names), None, [Entry(nd)])
        guard.attrs["shape"] = (-2,)
        guard.pos = u.pos - 0.5 + len(added) * 1e-6
        names.add(guard.name)
        added.append(guard)
        u.inputs[slot] = Entry(guard)
    if added:
        graph.nodes.extend(added)
        graph.mark_changed()
        graph.compact()


def guard_layer_outputs(graph: Graph) -> List[str]:
    """Insert the guards described above (in place); returns the names of the layers guarded."""
    found = _hazards(graph)
    _insert_guards(graph, [(nd, u, slot) for nd, fusable in found for u, slot in fusable])
    return [nd.name for nd, _ in found]


# ---------------------------------------------------------------- NaN and inf through a fused activation

# (layer op) -> the readers (``_nan_kind``) whose NaN and inf results MXNet 1.9.1's oneDNN backend changes
# when it fuses them into the layer (measured with the pip wheel: an input holding NaN, +inf and -inf,
# backend off vs on): after a FullyConnected, clip(0, 6) gives 0 for NaN (the clip op alone: NaN) and
# exp gives inf; after a Convolution, relu keeps NaN (the relu op alone: 0), sigmoid and clip give 0.
# Every other reader the backend fuses (tanh, softrelu, softsign, leaky, elu, gelu, selu, square, sqrt,
# abs) gave the op's own results.
NAN_CHANGED: Dict[str, frozenset] = {
    "FullyConnected": frozenset({"clip", "exp"}),
    "Convolution": frozenset({"clip", "relu", "sigmoid"}),
}


def _nan_kind(nd: Node) -> str:
    if nd.op == "Activation":
        return str(nd.param("act_type", ""))
    if nd.op == "LeakyReLU":
        return "leaky:" + str(nd.param("act_type", "leaky"))
    return nd.op


def nan_changing_fusions(graph: Graph) -> List[Tuple[Node, Node, int]]:
    """(layer, reader, input slot) for each reader MXNet's backend fuses into a layer with other NaN or
    inf results than the reader alone (``NAN_CHANGED``): a FullyConnected's, or a member's of a
    Convolution's chain."""
    users = graph.consumers()
    found = []
    for nd in graph.nodes:
        if nd.op == "FullyConnected":
            fused_ops, kind = FUSED_AFTER["FullyConnected"], "FullyConnected"
        elif nd.op in CONV_CHAIN_NEXT and _in_conv_chain(nd):
            fused_ops, kind = CONV_CHAIN_NEXT[nd.op] & _ACTS, "Convolution"
        else:
            continue
        for u, slot in users.get(nd, ()):
            if slot == 0 and u.inputs[0].index == 0 and u.op in fused_ops and _nan_kind(u) in NAN_CHANGED[kind]:
                found.append((nd, u, slot))
    return found


def guard_new_nan_fusions(graph: Graph, before: Set[str]) -> List[str]:
    """Guard (in place, as ``guard_layer_outputs`` does) each reader the backend would fuse into a layer
    with other NaN and inf results than its own, where the graph fused from did not have that fusion
    (``before``: its readers' names, from ``nan_changing_fusions``): a folded BatchNorm or a removed
    Dropout between a FullyConnected and a clip leaves them adjacent.  Finite values are the same
    either way; a model's NaN and inf stay as its default bind gave them.  Returns the readers' names."""
    new = [(nd, u, slot) for nd, u, slot in nan_changing_fusions(graph) if u.name not in before]
    _insert_guards(graph, new)
    return [u.name for _, u, _ in new]


# ---------------------------------------------------------------- training: prelu's γ gradient

def has_prelu(graph: Graph) -> bool:
    """Whether the graph has a ``LeakyReLU(act_type='prelu')``.

    MXNet 1.9.1 computes prelu's γ gradient wrong -- scaled by γ itself, as if its backward read
    the op's output where it reads its input -- when a library op runs after it (with a pooling
    after that), and when one that reads two or more inputs runs before it, even through stock
    ops in between (measured: fused_elemwise(x, r) -> +0 -> prelu); the same graphs with stock
    ops are right.  In training, no library op is put in such a graph.
    """
    return any(nd.op == "LeakyReLU" and nd.param("act_type", "leaky") == "prelu" for nd in graph.nodes)


# Ops whose gradient MXNet makes zeros (MakeZeroGradNodes).
ZERO_GRADIENT = frozenset({
    "BlockGrad", "stop_gradient", "sign", "round", "rint", "fix", "floor", "ceil", "trunc",
    "zeros_like", "ones_like", "shape_array", "size_array", "_contrib_arange_like", "argmax", "argmin",
    "broadcast_equal", "broadcast_not_equal", "broadcast_greater", "broadcast_greater_equal",
    "broadcast_lesser", "broadcast_lesser_equal", "_equal", "_not_equal", "_greater", "_greater_equal",
    "_lesser", "_lesser_equal", "_equal_scalar", "_not_equal_scalar", "_greater_scalar",
    "_greater_equal_scalar", "_lesser_scalar", "_lesser_equal_scalar"})


def zero_gradient(graph: Graph) -> set:
    """Ids of the nodes whose outputs get only zero gradients: read by nothing but ops of
    ``ZERO_GRADIENT``, as a where's condition, or by such nodes, and no graph output.  MXNet's
    gradient pass gives them zeros without running their backward; a library op there would run its own, where a
    gradient of 0 still meets a NaN or inf (0 · NaN is NaN)."""
    users = graph.consumers()
    heads = {id(e.node) for e in graph.heads}
    zero: set = set()
    for nd in reversed(graph.nodes):          # readers before what they read
        readers = users.get(nd, ())
        if readers and id(nd) not in heads and all(
                u.op in ZERO_GRADIENT or id(u) in zero or (u.op == "where" and slot == 0)   # a condition
                for u, slot in readers):
            zero.add(id(nd))
    return zero
