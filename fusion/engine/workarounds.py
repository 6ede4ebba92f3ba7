"""Keep fused graphs clear of a miscomputation in MXNet 1.9.1's oneDNN subgraph backend.

At bind, MXNet's default ("MKLDNN") subgraph backend fuses a FullyConnected or a
Convolution with the elementwise op that reads it.  When the layer's output is also
read elsewhere, MXNet 1.9.1 can hand a reader the wrong value (measured with the pip
wheel, subgraph backend on vs off):

* FullyConnected read by an op the backend fuses into it and by anything else (a graph
  output, a second activation, another layer — depending on the order of the readers):
  ``Group([relu(fc), fc])`` returns ``relu(fc)`` twice, ``Group([relu(fc), tanh(fc)])``
  returns ``tanh(relu(fc))``, ``Group([fc2(fc), relu(fc)])`` a wrong ``relu(fc)``;
* Convolution read by such an op and also a graph output (either order).

A rewrite can create that shape where the original graph did not have it (GELU
written out after a FullyConnected becomes ``LeakyReLU(gelu)``; a folded BatchNorm
puts the activation right after the convolution).  So after fusion, a layer output
that is read more than once, by at least one op the backend fuses into the layer,
reaches that op through ``Reshape(x, shape=(-2,))`` — the identity for every rank
(code −2 copies all remaining dimensions), which the backend does not fuse into the
layer, so every reader gets the value the graph says.
"""
from __future__ import annotations

from typing import Dict, List

from ..ir.graph import Entry, Graph, Node

# (layer op) -> ops MXNet 1.9.1's oneDNN backend fuses after it (measured with the pip wheel).
FUSED_AFTER: Dict[str, frozenset] = {
    "FullyConnected": frozenset({"Activation", "LeakyReLU", "square", "sqrt", "exp", "abs", "clip"}),
    "Convolution": frozenset({"Activation", "LeakyReLU", "clip", "elemwise_add", "BatchNorm"}),
}


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


def guard_layer_outputs(graph: Graph) -> List[str]:
    """Insert the guards described above (in place); returns the names of the layers guarded."""
    users = graph.consumers()
    heads = {}
    for e in graph.heads:
        heads[e] = heads.get(e, 0) + 1
    guarded: List[str] = []
    added: List[Node] = []
    for nd in list(graph.nodes):
        fused_ops = FUSED_AFTER.get(nd.op)
        if fused_ops is None:
            continue
        readers = [(u, slot) for u, slot in users.get(nd, ()) if u.inputs[slot].index == 0]
        is_head = heads.get(Entry(nd), 0) > 0
        uses = len(readers) + heads.get(Entry(nd), 0)
        fusable = [(u, slot) for u, slot in readers if u.op in fused_ops]
        if not fusable or uses < 2 or (nd.op == "Convolution" and not is_head):
            continue
        names = {n.name for n in graph.nodes}
        for u, slot in fusable:
            guard = Node("Reshape", graph.unique_name(u.name + "_guard", names), None, [Entry(nd)])
            guard.attrs["shape"] = (-2,)
            guard.pos = u.pos - 0.5 + len(added) * 1e-6
            names.add(guard.name)
            added.append(guard)
            u.inputs[slot] = Entry(guard)
        guarded.append(nd.name)
    if added:
        graph.nodes.extend(added)
        graph.mark_changed()
        graph.compact()
    return guarded


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
