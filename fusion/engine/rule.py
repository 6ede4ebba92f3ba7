"""A rule: a pattern, a check that explains refusals, and a rewrite.

Subclass :class:`Rule`, then::

    class FoldScale(Rule):
        name = "fold_scale"
        benefit = 5                     # larger patterns get a larger benefit and run first

        def pattern(self):
            return scalar("mul", op.FullyConnected(Var("x"), Const("w"), name="fc"), name="s")

        def check(self, m):             # None to accept, else a reason a user can read
            if m.value("w") is None:
                return "needs the value of the FullyConnected weight (pass params)"

        def rewrite(self, m, b):        # returns the value that replaces the anchor's output
            w = b.param(m.node("fc").name + "_scaled_weight", m.value("w") * m.node("s").attrs["scalar"])
            return b.op("FullyConnected", [m["x"], w], attrs=m.node("fc").attrs)

Rules keep no state between ``check`` and ``rewrite``: both read the match.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple, Union

from ..ir.graph import Entry
from ..ir.matcher import Match
from ..ir.pattern import Pattern


class Rule:
    #: Unique name, shown in reports and accepted by ``fuse(..., rules=[...])``.
    name: str = ""
    #: Rules run in decreasing benefit, so larger patterns claim their nodes first.
    benefit: int = 0
    #: Rewrites valid only at inference (e.g. they read BatchNorm's moving statistics).
    inference_only: bool = False
    #: Reason reported when an inference-only rule meets ``mode="training"``.
    training_reason: str = "rewrite is inference-only; refused in mode='training'"
    #: A clean-up that applies only where it happens to (a reshape that gives back its input's
    #: shape): its refusals would list every op it looks at, so they are near-misses (--explain).
    quiet_refusals: bool = False
    #: Names of matched nodes (besides the anchor) whose outputs the rewrite also replaces.
    exports: Tuple[str, ...] = ()
    #: One line for reports.
    description: str = ""
    #: Rules of one family are variants of one fusion (e.g. with and without an activation tail).
    family: str = ""
    #: Name of the matched node that identifies a candidate across the family's variants: once
    #: a variant fuses it, the larger variants' rejections of it are no longer news.
    key: Optional[str] = None
    #: Library ops the rewrites emit, for what the caller decides before the rules run (under
    #: precision="bf16", convolutions an emitted op computes in bfloat16 itself are not handed to
    #: MXNet's AMP first: fusion/precision/policy.py ``convolutions_fused``).
    emits: Tuple[str, ...] = ()

    def pattern(self) -> Pattern:
        raise NotImplementedError

    def check(self, m: Match) -> Optional[str]:
        return None

    def exported(self, m: Match) -> Set[int]:
        """The ids of matched nodes (besides the anchor) whose outputs the rewrite also replaces, so
        they may be read outside the match or be graph outputs: by default those ``exports`` names."""
        return {id(m.node(n)) for n in self.exports if m.has(n)}

    def outside_use_ok(self, m: Match, entry: Entry, user: Any) -> bool:
        """Whether ``user``, outside the match, may keep reading the interior value ``entry``.

        Only for a rule whose rewrite then maps ``entry`` to a value that serves that user
        exactly (returned in its replacement dict).  Default: no interior value escapes.
        """
        return False

    def rewrite(self, m: Match, b: "Builder") -> Union[Entry, Dict[Entry, Entry]]:
        raise NotImplementedError

    def refused(self, m: Match, reason: str) -> None:
        """Told when a candidate ``check`` accepted is refused after all: its rewrite failed or the
        self-check found it computes something else.  A rule that other rules stand aside for
        notes it in ``m.ctx.memo`` so that they take the candidate in the next pass.  Default: nothing."""

    def __repr__(self) -> str:
        return "<rule %s (benefit %d)>" % (self.name, self.benefit)


from .rewrite import Builder  # noqa: E402  (type used in signatures above)
