"""Serving a fused model: its graph uses mxnet-fusion's operators, which stock MXNet does not know.

``fusion.load_model(prefix)`` loads a fused checkpoint in one line (registering the operators
first); where mxnet-fusion is not installed, ``mxfuse ... --unfuse`` writes a copy in stock ops.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple


def load_library() -> str:
    """Register mxnet-fusion's operators with MXNet (``import fusion`` does it too); returns the library's path."""
    from ..native.library import load

    return load()


def load_model(prefix: str, epoch: int = 0) -> Tuple[Any, dict, dict]:
    """``(symbol, arg_params, aux_params)`` of ``PREFIX-symbol.json`` / ``PREFIX-%04d.params``, fused ops and all."""
    import mxnet as mx

    load_library()
    return mx.model.load_checkpoint(prefix, epoch)


def fused_ops(graph: Any) -> List[str]:
    """The mxnet-fusion operators a graph uses (stock MXNet cannot load it while there are any)."""
    return sorted({n.op for n in graph.op_nodes() if n.op.startswith("fused_")})


def serving_note(graph: Any, output: Optional[str] = None) -> Optional[str]:
    """The report's note on how to load a fused graph elsewhere (None when it uses stock ops only)."""
    ops = fused_ops(graph)
    if not ops:
        return None
    where = output or "PREFIX"
    return ("the fused model uses mxnet-fusion's operators (%s): load it after `import fusion`, or in one line "
            "with `fusion.load_model('%s')`; for stock MXNet without mxnet-fusion, write a copy in stock ops with "
            "`mxfuse %s-symbol.json --params %s-0000.params --unfuse -o PLAIN`"
            % (", ".join(ops), where, where, where))


def add_note(report: Any, graph: Any, output: Optional[str] = None) -> None:
    note = serving_note(graph, output)
    if note:
        report.notes.append(note)
