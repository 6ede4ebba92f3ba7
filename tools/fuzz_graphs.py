#!/usr/bin/env python3
"""Grammar fuzzer for mxnet-fusion: generate graphs, fuse them, check they compute the same.

    .venv/bin/python tools/fuzz_graphs.py --graphs 2000 --seed 1 --jobs 2 --out fuzz_failures

prints a summary (graphs, valid, failing graphs per check and family, per-rule fire and
rejection counts, failure classes with a reproducer each) and writes every failing graph
as a standalone reproducer to --out (the first of each failure class also shrunk:
``min-*.py``).  The same --seed gives the same graphs.  Exit status 1 when anything failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    from tools.fuzz.families import FAMILIES
    from tools.fuzz.oracle import CHECKS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", type=int, default=500, help="number of graphs (default 500)")
    p.add_argument("--seed", type=int, default=0, help="run seed: the same seed gives the same graphs")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--families", default="", help="comma-separated subset of: " + ", ".join(FAMILIES))
    p.add_argument("--checks", default="", help="comma-separated subset of the oracle's checks: " + ", ".join(CHECKS)
                   + " (default: all)")
    p.add_argument("--out", default="", help="folder for reproducers (default: none written)")
    p.add_argument("--time-limit", type=float, default=0, help="stop starting new graphs after this many seconds")
    p.add_argument("--timeout", type=float, default=120, help="seconds per graph before its worker is killed")
    p.add_argument("--shrink", type=int, default=1, help="failures shrunk per failure class (0: none; needs --out)")
    p.add_argument("--shrink-seconds", type=float, default=90, help="time budget of one shrink")
    p.add_argument("--threads", type=int, default=0, help="OpenMP threads per worker (default 1: on shared cores 2 are 10x slower)")
    p.add_argument("--json", default="", help="also write the summary as JSON here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    a = p.parse_args(argv)

    os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")
    from tools.fuzz.runner import format_summary, fuzz
    from patterns import default_rules

    t0 = time.time()
    done = [0]

    def progress(task, result):
        done[0] += 1
        if not a.quiet and (done[0] % 25 == 0 or "crash" in result):
            bad = " crash in %s (seed %d)" % (result["crash"], task["seed"]) if "crash" in result else ""
            print("\r%d/%d graphs, %.0f s%s" % (done[0], a.graphs, time.time() - t0, bad),
                  end="\n" if bad else "", file=sys.stderr, flush=True)

    families = [f for f in a.families.split(",") if f] or None
    try:
        sm = fuzz(a.graphs, a.seed, families, a.jobs, a.timeout, a.out or None, a.time_limit or None,
                  a.shrink if a.out else 0, a.shrink_seconds, progress, a.threads,
                  [k for k in a.checks.split(",") if k] or None)
    except ValueError as e:          # unknown families or checks
        p.error(str(e))
    if not a.quiet:
        print(file=sys.stderr)
    rules = []
    for r in default_rules():
        if r.name not in rules:
            rules.append(r.name)
    print(format_summary(sm, rules))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"graphs": sm.graphs, "valid": sm.valid, "invalid": sm.invalid, "gen_invalid": sm.gen_invalid,
                       "failing": sm.failing, "seconds": sm.seconds, "findings": sm.findings,
                       "by_family": {k: dict(v) for k, v in sm.by_family.items()}, "fired": sm.fired,
                       "rejected": sm.rejected, "fired_training": sm.fired_training, "counters": sm.counters,
                       "classes": sm.classes}, f, indent=1, default=str)
    return 1 if sm.failing or sm.harness_errors else 0


if __name__ == "__main__":
    sys.exit(main())
