"""fused_elemwise's expression program (its ``expr`` attribute) read into a tree.

The program is a nest of calls over the op's inputs ``x0, x1, ...`` and number constants:
``mul(x0, div(clip(add(x0, 3.0), 0.0, 6.0), 6.0))``.  The un-fusing rule rebuilds it from stock
ops and the ONNX export writes it as ONNX nodes, both from this tree.
"""
from __future__ import annotations

import re

_TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan))"
                    r"|(?P<name>[A-Za-z_][A-Za-z_0-9]*)|(?P<punct>[(),]))")


def parse_expr(text: str):
    """The program as a tree: ("num", v) | ("in", k) | (fn, [args]); the builder adds
    ("val", v) leaves for values it has emitted already.  Without recursion: a program may
    nest as deep as MXNet loads (fusion/ir/graph.py: MAX_EXPR_DEPTH)."""
    tokens = [(t.lastgroup, t.group(t.lastgroup)) for t in _TOKEN.finditer(text)]
    frames: list = []           # (fn, args) of the calls still open
    result = None
    k = 0
    while k < len(tokens):
        kind, val = tokens[k]
        k += 1
        if kind == "punct":
            if val == ")":
                assert frames, "unbalanced ) in %r" % text[:80]
                node = tuple(frames.pop())
            else:
                assert val == "," and frames, "unexpected %r in %r" % (val, text[:80])
                continue
        elif kind == "num":
            node = ("num", float(val))
        elif re.fullmatch(r"x\d+", val):
            node = ("in", int(val[1:]))
        else:
            assert k < len(tokens) and tokens[k] == ("punct", "("), "expected ( after %s" % val
            k += 1
            frames.append((val, []))
            continue
        if frames:
            frames[-1][1].append(node)
        else:
            assert result is None, "more than one expression in %r" % text[:80]
            result = node
    assert result is not None and not frames, "incomplete expression %r" % text[:80]
    return result
