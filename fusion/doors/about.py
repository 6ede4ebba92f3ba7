"""What a run is made of: ``mxfuse --version``, ``mxfuse --list-rules``, and the facts a report records
(versions of mxnet-fusion, MXNet and Python; the command line; the input shapes)."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..version import versions


def version_line() -> str:
    v = versions()
    return "mxfuse %s (MXNet %s, Python %s)" % (v["mxnet_fusion"], v["mxnet"], v["python"])


def rules_text() -> str:
    """The rule library as a table: rule, family, whether it is for inference only, what it matches."""
    from patterns import FAMILIES, rule_table

    rows = [("rule", "family", "mode", "matches -> rewrite")] + rule_table()
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    lines.append("")
    lines.append("--rules takes rule names and family names: %s (a family is all its rules; a rule's family "
                 "'-' means it has none)" % ", ".join(sorted(FAMILIES)))
    return "\n".join(lines)


class VersionAction(argparse.Action):
    """``--version``: print the versions (MXNet's too) and exit 0; MXNet is imported only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit(0)


class ListRulesAction(VersionAction):
    """``--list-rules``: print the rule table and exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(rules_text())
        parser.exit(0)


def command_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["mxfuse"] + list(argv))


def run_info(argv: Optional[Sequence[str]], shapes: Mapping[str, Sequence[int]]) -> Dict[str, Any]:
    """What a report records about the run besides the fusion: the command line and the input shapes."""
    return {"command_line": command_line(sys.argv[1:] if argv is None else argv),
            "input_shapes": {k: list(v) for k, v in shapes.items()}}


def describe_run(report: Any) -> List[str]:
    """Lines naming the versions, input shapes and command line a report records (for text and HTML)."""
    v = versions()
    lines = ["mxnet-fusion %s, MXNet %s, Python %s" % (v["mxnet_fusion"], v["mxnet"], v["python"])]
    shapes = report.extra.get("input_shapes")
    if shapes:
        lines.append("input shapes: " + ", ".join("%s=%s" % (k, ",".join(map(str, s))) for k, s in shapes.items()))
    if report.extra.get("command_line"):
        lines.append("command: " + report.extra["command_line"])
    return lines
