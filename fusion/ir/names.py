"""The fused graph's outputs keep the names the original gave them.

MXNet names an output after the node that computes it (``bn0_output``; a variable by its own
name; a node of several outputs ``x_output0``, ``x_output1``).  A rewrite replaces that node:
BatchNorm folded into the convolution before it leaves ``conv0_output`` where the model had
``bn0_output``, a removed Dropout leaves its input's name, ``fused_add_layer_norm`` (two outputs)
``ln0_output0``, a folded parameter its own.  Code that reads outputs by name
(``executor.output_dict``, a metric's ``output_names``, a serving signature) would then miss
them, so ``fuse`` and ``unfuse`` name them back, at no cost where they can:

* the node computing the output has one output and no other graph output: it takes the name
  the output's node had (``conv0`` is renamed ``bn0``);
* otherwise (a node of several outputs, a variable, a value that is two outputs at once) an
  identity ``_copy`` named as that node hands the value out; a node that holds the name
  already (a fused op named after the node it replaced) is renamed ``<name>_fused`` first.

An output that was a float32 variable (an input or a parameter the model hands out) and is now a
cast of it that changes nothing (MXNet's AMP casts outputs back to float32) is the variable
again.  An output whose original name MXNet derives otherwise (``bn0_mean``, ``split0_output1``),
or a variable's whose value changed (a parameter AMP holds in bfloat16), cannot be spelled by
any node and keeps the new name: ``keep_output_names`` returns those, and the report says so.
"""
from __future__ import annotations

import json
import re
from typing import Dict, List, Optional, Set, Tuple

from .graph import Entry, Graph, Node

#: a fused op of several outputs records, per output, the value of the graph it was fused from that
#: the output gives back (a JSON list of ``[node name, output index]``, ``null`` where none): a
#: region's outputs are the values of several of the original's nodes, and its own name says only
#: one of them.  ``fusion.verify`` reads it to cut a fused graph where the original's values are
#: (``fusion/check/cuts.py``); MXNet keeps ``__*__`` attributes through save and load, and the ops
#: ignore them.
GIVES_BACK = "__gives_back__"


def gives_back(entry: Entry) -> Tuple[str, int]:
    """The (node name, output index) of the fused-from graph's value that ``entry`` gives back: as
    its node's ``GIVES_BACK`` records it where it does, else the entry's own."""
    raw = entry.node.attrs.raw(GIVES_BACK) if entry.node.num_outputs > 1 else None
    if raw is not None:
        try:
            got = json.loads(raw)[entry.index]
            if got is not None:
                return str(got[0]), int(got[1])
        except (ValueError, TypeError, IndexError, KeyError):
            pass            # a hand-edited attribute: the entry's own name, as without one
    return entry.node.name, entry.index


def keep_output_names(graph: Graph, names: List[str],
                      float32_vars: Optional[Set[str]] = None) -> Tuple[List[str], Dict[str, str]]:
    """Name ``graph``'s outputs as ``names`` (the original's ``list_outputs()``), in place.

    ``float32_vars``: variables known to be float32; an output that was such a variable and is now
    a value-preserving cast of it (MXNet's AMP casts every output back to float32, inputs and
    parameters included) is that variable again.  Returns ``(lost, renamed)``: ``"old -> new"``
    for each output whose name could not be kept, and the nodes renamed (name before -> now)."""
    now = graph.to_symbol().list_outputs()
    if len(now) != len(names) or now == names:
        return [], {}
    heads_before = list(graph.heads)
    renames: List[tuple] = []                                   # (node, its name before)
    taken = {nd.name: nd for nd in graph.nodes}
    copies: List[Node] = []
    done: Dict[tuple, Entry] = {}                               # (entry, name) -> the entry named so

    def rename(nd: Node, name: str) -> None:
        taken.pop(nd.name, None)
        renames.append((nd, nd.name))
        nd.name = name
        taken[name] = nd

    for i, (old, new) in enumerate(zip(names, now)):
        if old == new:
            continue
        e = graph.heads[i]
        if (e, old) in done:                                    # the same value, output twice
            graph.heads[i] = done[(e, old)]
            continue
        m = re.fullmatch(r"(.+)_output", old)
        if not m:
            v = _cast_of(e, old, float32_vars or set())
            if v is not None:
                graph.heads[i] = done[(e, old)] = v
            continue
        base, nd = m.group(1), e.node
        alone = all(h == e and n == old for h, n in zip(graph.heads, names) if h.node is nd)
        if not nd.is_variable and alone and new == nd.name + "_output" and base not in taken:
            rename(nd, base)
            done[(e, old)] = e
            continue
        holder = taken.get(base)
        if holder is not None:
            # a node took the name (a fused op named after the node it replaced): it gives it up,
            # unless it is a variable (a parameter's name is part of the params file) or another
            # output is to keep a name of it
            if holder.is_variable or any(re.fullmatch(re.escape(base) + r"_output\d*", n) and (h, n) != (e, old)
                                         for h, n in zip(heads_before, names)):
                continue
            rename(holder, graph.unique_name(base + "_fused", set(taken)))
        copy = Node("_copy", base, None, [e])
        copy.pos = max(n.pos for n in graph.nodes) + 1 + len(copies)
        taken[base] = copy
        copies.append(copy)
        graph.heads[i] = done[(e, old)] = Entry(copy)
    if copies:
        graph.nodes.extend(copies)
    graph.mark_changed()
    graph.compact()
    after = graph.to_symbol().list_outputs()
    if any(a != b and b == n for a, b, n in zip(after, now, names)):
        # an output that had its name lost it: undo everything (not expected; never worse than before)
        for nd, name in reversed(renames):
            nd.name = name
        graph.heads = heads_before
        graph.mark_changed()
        graph.compact()
        after = now
        renames = []
    return ["%s -> %s" % (n, a) for n, a in zip(names, after) if n != a], {name: nd.name for nd, name in renames}


def _cast_of(e: Entry, name: str, float32_vars: Set[str]) -> Optional[Entry]:
    """The float32 variable ``name`` where ``e`` is it through ``amp_cast`` to float32 and
    ``_copy`` only (the same values, the same dtype); else None."""
    while not e.node.is_variable:
        nd = e.node
        if len(nd.inputs) != 1 or not (nd.op == "_copy" or (nd.op == "amp_cast" and
                                                              str(nd.attrs.to_json().get("dtype")) == "float32")):
            return None
        e = nd.inputs[0]
    return e if e.node.name == name and name in float32_vars else None
