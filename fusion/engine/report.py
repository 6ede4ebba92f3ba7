"""What a fusion run did: per rule, matches fused, candidates rejected and why, near-misses."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple


def no_value_reason(ctx: Any, name: str, role: str) -> str:
    """Why the value read as ``role`` (e.g. "bias") has neither a value nor a known shape, blaming the right thing."""
    if not ctx.has_params:
        return "%s '%s' has neither a value nor a known shape (pass params)" % (role, name)
    if name in ctx.arg_params or name in ctx.aux_params:
        return "%s '%s' has a value but no known shape" % (role, name)
    return ("'%s', read as a %s, is not a parameter (the params do not hold it: it is an input of the graph) "
            "and its shape is unknown (give it with --shape)" % (name, role))


_NAMED = re.compile(r"(?: at)? '[^'\s]+'")


def reason_kind(reason: str) -> str:
    """A reason without the node names it quotes: reasons of one kind at many places group under it."""
    return _NAMED.sub("", reason)


def group_reasons(by_anchor: Dict[str, str]) -> List[Tuple[str, List[str]]]:
    """(kind of reason, anchors) most frequent first; a kind seen once keeps its reason with the names."""
    kinds: Dict[str, List[str]] = {}
    first: Dict[str, str] = {}
    for anchor, reason in by_anchor.items():
        kind = reason_kind(reason)
        kinds.setdefault(kind, []).append(anchor)
        first.setdefault(kind, reason)
    return [(kind if len(anchors) > 1 else first[kind], anchors)
            for kind, anchors in sorted(kinds.items(), key=lambda kv: -len(kv[1]))]


def _places(anchors: List[str], shown: int = 3) -> str:
    return ", ".join(anchors[:shown]) + (" (+%d more)" % (len(anchors) - shown) if len(anchors) > shown else "")


@dataclass
class RuleReport:
    name: str
    benefit: int
    description: str = ""
    fused: List[Dict[str, Any]] = field(default_factory=list)      # {"anchor", "nodes": [...], "new": [...]}
    rejected: Dict[str, str] = field(default_factory=dict)         # anchor name -> reason
    near_misses: Dict[str, str] = field(default_factory=dict)      # anchor name -> first failure
    nodes_removed: int = 0
    params_added: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return {
            "rule": self.name, "benefit": self.benefit, "description": self.description,
            "fused": len(self.fused), "matches": self.fused,
            "rejected": [{"anchor": a, "reason": r} for a, r in self.rejected.items()],
            "near_misses": [{"anchor": a, "reason": r} for a, r in self.near_misses.items()],
            "near_miss_kinds": [{"reason": k, "count": len(a), "anchors": a}
                                for k, a in group_reasons(self.near_misses)],
            "nodes_removed": self.nodes_removed, "params_added": self.params_added,
        }


@dataclass
class FusionReport:
    mode: str = "inference"
    precision: str = "float32"
    device: str = "cpu"          # where the fused graph runs: library ops emitted only where implemented
    rules: Dict[str, RuleReport] = field(default_factory=dict)
    ops_before: int = 0
    ops_after: int = 0
    nodes_before: int = 0
    nodes_after: int = 0
    passes: int = 0
    params_removed: int = 0
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)   # verification, benchmark figures
    self_check: Any = None      # fusion.engine.selfcheck.CheckStats, or None when the self-check was off
    _rejected_keys: Dict[Any, Any] = field(default_factory=dict, repr=False)

    def reject(self, rule: Any, anchor: str, key: str, reason: str) -> None:
        """Record a rejected candidate, once per family and key.

        Variants run largest first, so a later rejection of the same key by another rule
        of the family comes from a smaller variant: its reason is the more fundamental one
        and replaces the earlier.  Within one rule, the first (largest) candidate's reason stays.
        """
        owner = self._rejected_keys.get((rule.family or rule.name, key))
        if owner is not None and owner[0] == rule.name:
            return
        self.forget_rejections(rule, key)
        self._rejected_keys[(rule.family or rule.name, key)] = (rule.name, anchor)
        self.rule(rule).rejected[anchor] = reason

    def forget_rejections(self, rule: Any, key: str, fused_at: Optional[str] = None) -> None:
        """Drop the family's rejection of the candidate ``key``.

        ``fused_at``: a variant fused the candidate there, in a smaller form; the dropped
        reason says why the larger form was not taken, so it stays, as a near-miss.
        """
        owner = self._rejected_keys.pop((rule.family or rule.name, key), None)
        if owner is None:
            return
        reason = self.rules[owner[0]].rejected.pop(owner[1], None)
        if reason is not None and fused_at is not None:
            self.rules[owner[0]].near_misses[owner[1]] = (
                "fused in a smaller form (%s at '%s'); the larger one was refused: %s"
                % (rule.name, fused_at, reason))

    def rule(self, rule: Any) -> RuleReport:
        r = self.rules.get(rule.name)
        if r is None:
            r = self.rules[rule.name] = RuleReport(rule.name, rule.benefit, rule.description)
        return r

    @property
    def fused_count(self) -> int:
        return sum(len(r.fused) for r in self.rules.values())

    def same_as_bind(self) -> Dict[str, int]:
        """Rewrites that only do what MXNet's own default bind does with the ops they replace (a
        BatchNorm folded into a convolution, which MXNet's oneDNN backend folds at bind too; a no-op
        removed), counted per kind (``Builder.same_as_bind``)."""
        kinds: Dict[str, int] = {}
        for r in self.rules.values():
            for f in r.fused:
                if f.get("same_as_bind"):
                    kinds[f["same_as_bind"]] = kinds.get(f["same_as_bind"], 0) + 1
        return kinds

    @property
    def beyond_bind_count(self) -> int:
        """Rewrites that do more than MXNet's own default bind does with the ops they replace."""
        return self.fused_count - sum(self.same_as_bind().values())

    def nothing_beyond_bind(self) -> bool:
        """Whether the fused model runs as MXNet's default bind runs the original: every rewrite (if
        any) is one that bind makes itself, in float32 (bf16 hands convolutions to MXNet's AMP), and a
        fusion pass ran (a report of ``mxfuse --unfuse`` claims nothing)."""
        return self.passes > 0 and self.precision == "float32" and self.beyond_bind_count == 0

    def to_dict(self) -> Dict[str, Any]:
        from ..version import versions

        return {
            "versions": versions(),
            "mode": self.mode, "precision": self.precision, "device": self.device, "passes": self.passes, "seconds": round(self.seconds, 4),
            "ops_before": self.ops_before, "ops_after": self.ops_after,
            "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
            "params_removed": self.params_removed, "fused": self.fused_count,
            "fused_beyond_bind": self.beyond_bind_count, "same_as_bind": self.same_as_bind(),
            "nothing_beyond_bind": self.nothing_beyond_bind(),
            "rules": [r.to_dict() for r in self.rules.values()],
            "self_check": self.self_check.to_dict() if self.self_check is not None else None,
            "notes": self.notes, **self.extra,
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_text(self, explain: bool = False) -> str:
        lines = ["mxnet-fusion report (mode=%s%s): %d fused, ops %d -> %d, nodes %d -> %d, %d pass(es), %.3f s"
                 % (self.mode, ("" if self.precision == "float32" else ", precision=" + self.precision)
                    + ("" if self.device == "cpu" else ", device=" + self.device),
                    self.fused_count, self.ops_before, self.ops_after, self.nodes_before, self.nodes_after, self.passes, self.seconds)]
        wanting = self.extra.get("more_with_input_shapes")
        if self.nothing_beyond_bind():     # what to expect, plainly: the same speed as MXNet's default bind
            kinds = sorted(self.same_as_bind().items(), key=lambda kv: (-kv[1], kv[0]))
            lines[0] += "; nothing to fuse beyond MXNet's own bind%s%s" % (
                " without input shapes" if wanting else "",
                " (only %s)" % "; ".join("%d %s" % (n, k) for k, n in kinds) if kinds else "")
        if wanting:     # refused for want of input shapes only: the summary says what they would give
            lines[0] += "; up to %d more rewrite(s) with input shapes (--shape / input_shapes)" % wanting
        width = max([len(r.name) for r in self.rules.values()] + [4])
        lines.append("  %-*s  %6s  %8s  %13s  %6s" % (width, "rule", "fused", "rejected", "nodes removed", "params"))
        quiet = []
        for r in self.rules.values():
            if not (r.fused or r.rejected or (explain and r.near_misses)):
                quiet.append(r.name)
                continue
            lines.append("  %-*s  %6d  %8d  %13d  %6d" % (width, r.name, len(r.fused), len(r.rejected),
                                                           r.nodes_removed, r.params_added))
        if quiet and explain:
            lines.append("  no candidates for: " + ", ".join(quiet))
        elif quiet:
            lines.append("  %d other rule(s) found no candidates (--explain lists them)" % len(quiet))
        for r in self.rules.values():
            reasons: Dict[str, List[str]] = {}
            for anchor, reason in r.rejected.items():
                reasons.setdefault(reason, []).append(anchor)
            for reason, anchors in reasons.items():
                shown = ", ".join(anchors[:3]) + (" (+%d more)" % (len(anchors) - 3) if len(anchors) > 3 else "")
                lines.append("  rejected %s at %s: %s" % (r.name, shown, reason))
        for r in self.rules.values():
            lines.extend(_detail_lines(r, explain))
        if explain:
            for r in self.rules.values():
                groups = group_reasons(r.near_misses)
                if not groups:
                    continue
                lines.append("  near-misses of %s: %d, %d kind(s)" % (r.name, len(r.near_misses), len(groups)))
                for reason, anchors in groups:
                    lines.append("    %d× %s  (at %s)" % (len(anchors), reason, _places(anchors)))
        c = self.self_check
        if c is not None:
            line = "  self-check: %d rewrite(s) checked%s" % (c.checked, " at %d input shape(s)" % len(c.probes)
                                                            if c.probes else "")
            if c.checked:
                line += ", worst relative error %.2g (%s)" % (c.worst_rel, c.worst_at)
            alone, smaller = getattr(c, "alone", 0), getattr(c, "alone_smaller", 0)
            if getattr(c, "size_free", 0) > smaller:
                line += "; %d of them at smaller input shapes only (they name no size)" % (c.size_free - smaller)
            if alone:
                line += "; %d of them on their own on drawn inputs%s" % (
                    alone, " (%d at smaller shapes: they name no size)" % smaller if smaller else "")
            if c.sampled:
                line += "; %d more identical in structure and shapes to checked ones" % c.sampled
            if c.refused:
                line += "; %d refused (reasons above)" % c.refused
            if c.unchecked:
                line += "; %d not checked (%s)" % (c.unchecked, "; ".join(
                    "%s: %d" % kv for kv in sorted(c.unchecked_reasons.items())))
            lines.append(line)
        v = self.extra.get("verify")
        if v:
            lines.append("  verify: max abs error %.3g, max rel error %.3g (tolerance %.3g): %s"
                         % (v["max_abs"], v["max_rel"], v["rtol"], v.get("status") or ("OK" if v["ok"] else "MISMATCH")))
            lines.extend("  verify: " + p for p in v.get("problems", ()))
            lines.extend("  verify: " + d for d in v.get("details", ()))
        b = self.extra.get("benchmark")
        if b:
            lines.extend("  " + ln for ln in benchmark_lines(b))
        lines.extend("  note: " + n for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


#: Rewrites whose details (``Builder.details``) the text report lists per rule without --explain.
DETAILS_SHOWN = 6


def _detail_lines(r: RuleReport, explain: bool) -> List[str]:
    """The rewrites of ``r`` that say more about themselves (a region: its ops and where it was cut):
    one line each (the first DETAILS_SHOWN without --explain), and with --explain their lines below."""
    described = [f["details"] for f in r.fused if f.get("details", {}).get("summary")]
    shown = described if explain else described[:DETAILS_SHOWN]
    out = []
    for d in shown:
        out.append("  %s" % d["summary"])
        if explain:
            out.extend("    %s" % ln for ln in d.get("lines", ()))
    if len(described) > len(shown):
        out.append("  (+%d more %s rewrite(s); --explain lists them)" % (len(described) - len(shown), r.name))
    return out


def benchmark_lines(b: Mapping[str, Any]) -> List[str]:
    """The benchmark figures as text lines (the report's)."""
    med, p10, p90 = b["median_ms"], b.get("p10_ms"), b.get("p90_ms")
    if p10 and p90:
        lines = ["benchmark (ms, median [p10-p90] of %s interleaved rounds): " % b.get("rounds", "?") + ", ".join(
            "%s %.3f [%.3f-%.3f]" % (k, v, p10[k], p90[k]) for k, v in med.items())]
    else:
        lines = ["benchmark (median ms): " + ", ".join("%s %.3f" % kv for kv in med.items())]
    lines.append("speed-up, like for like: %.2fx with the subgraph backend on (MXNet's default bind), %.2fx with it "
                 "off on both" % (b["speedup_vs_mxnet_default"], b["speedup_both_subgraph_off"])
                 if "speedup_both_subgraph_off" in b else
                 "speed-up: %.2fx vs MXNet default bind" % b["speedup_vs_mxnet_default"])
    if "speedup_vs_subgraph_off" in b:
        lines.append("fused (backend on) vs original with the backend off: %.2fx" % b["speedup_vs_subgraph_off"])
    lines.extend(b.get("within_noise", ()))
    lines.extend("WARNING: " + w for w in b.get("warnings", ()))
    return lines
