"""Delta debugging over a case's choice sequence: the smallest graph that still fails the same way.

The generator draws every decision through :class:`~tools.fuzz.draw.Draw`, index 0
being the simplest (an optional step absent, the first size).  The shrinker edits
the recorded sequence — zeroing runs of 8, 4, 2 and 1 decisions, then lowering single
ones — regenerates the case, and keeps an edit when the same check (e.g.
``inference.values``) still fails on it.  Edits that make MXNet refuse the original
graph, or the generator give up, are simply not kept.  It stops at a fixpoint or when
its budget (attempts, seconds) is spent.
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

from .case import Case, Invalid
from .generator import generate
from .oracle import Finding, Oracle


def _fails(seed: int, family: str, choices: List[int], check: str) -> Optional[Tuple[Case, Finding]]:
    try:
        case = generate(seed, family, replay=choices)
    except Invalid:
        return None
    except Exception:         # a clamped replay the generator cannot build: not a candidate
        return None
    out = Oracle(case, only=[check.split(".")[0]]).run()
    if not out.valid:
        return None
    for f in out.findings:
        if f.check == check:
            return case, f
    return None


def shrink(case: Case, finding: Finding, max_attempts: int = 200, max_seconds: float = 90.0,
           progress: Callable[[str], None] = lambda s: None) -> Tuple[Case, Finding, int]:
    """(smallest failing case, its finding, attempts made)."""
    t0 = time.perf_counter()
    best, best_f = case, finding
    choices = list(case.choices)
    attempts = 0

    def budget() -> bool:
        return attempts < max_attempts and time.perf_counter() - t0 < max_seconds

    def smaller(c: Case) -> bool:
        return (c.op_count(), sum(c.choices)) < (best.op_count(), sum(best.choices))

    improved = True
    while improved and budget():
        improved = False
        for k in (8, 4, 2, 1):
            i = 0
            while i < len(choices) and budget():
                if any(choices[i:i + k]):
                    cand = choices[:i] + [0] * len(choices[i:i + k]) + choices[i + k:]
                    attempts += 1
                    r = _fails(case.seed, case.family, cand, finding.check)
                    if r is not None and smaller(r[0]):
                        best, best_f = r
                        choices = list(best.choices)
                        improved = True
                        progress("%d ops" % best.op_count())
                        continue
                i += k
        for i in range(len(choices)):
            if not budget() or i >= len(choices):
                break
            if choices[i] > 1:
                for v in (1, choices[i] // 2, choices[i] - 1):
                    cand = choices[:i] + [v] + choices[i + 1:]
                    attempts += 1
                    r = _fails(case.seed, case.family, cand, finding.check)
                    if r is not None and smaller(r[0]):
                        best, best_f = r
                        choices = list(best.choices)
                        improved = True
                        break
                    if not budget():
                        break
    return best, best_f, attempts
