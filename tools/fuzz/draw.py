"""Random decisions recorded as a sequence of small integers, so a graph can be replayed and shrunk.

Every decision the generator makes goes through a :class:`Draw`: ``d.choice(options)``,
``d.maybe(p)``, ``d.int(lo, hi)``.  Each records the index it picked.  Replaying a
recorded (or edited) sequence rebuilds the same graph; a position past the end of
the sequence, or a value out of range, reads as 0 (clamped).  The generator is
written so that index 0 is always the simplest option (an optional step absent,
the first/smallest size), so the shrinker (``shrink.py``) simplifies a graph by
lowering entries of its sequence toward 0 — the way Hypothesis shrinks its choice
sequences.
"""
from __future__ import annotations

import random
from typing import List, Optional, Sequence, TypeVar

T = TypeVar("T")


class Draw:
    def __init__(self, seed: Optional[int] = None, replay: Optional[Sequence[int]] = None):
        self.rng = random.Random(seed)
        self.replay = list(replay) if replay is not None else None
        self.record: List[int] = []
        self.labels: List[str] = []       # what each decision was (for reproducer comments / debugging)

    def _pick(self, n: int, weights: Optional[Sequence[float]], label: str) -> int:
        if n <= 0:
            raise ValueError("empty choice (%s)" % label)
        i = len(self.record)
        if self.replay is not None:
            v = self.replay[i] if i < len(self.replay) else 0
            v = max(0, min(int(v), n - 1))
        elif weights is None:
            v = self.rng.randrange(n)
        else:
            v = self.rng.choices(range(n), weights=weights)[0]
        self.record.append(v)
        self.labels.append(label)
        return v

    def choice(self, options: Sequence[T], weights: Optional[Sequence[float]] = None, label: str = "") -> T:
        """One of ``options``; put the simplest first (shrinking moves toward index 0)."""
        options = list(options)
        return options[self._pick(len(options), weights, label)]

    def maybe(self, p: float = 0.5, label: str = "") -> bool:
        """True with probability ``p`` (False is the simpler value)."""
        return bool(self._pick(2, (1.0 - p, p), label))

    def int(self, lo: int, hi: int, label: str = "") -> int:
        """An integer in [lo, hi], uniformly (lo is the simplest)."""
        return lo + self._pick(hi - lo + 1, None, label)

    def seed(self, label: str = "seed") -> int:
        """A seed for NumPy value generators (a single decision; shrinking it to 0 keeps it valid)."""
        return self._pick(1 << 30, None, label)
