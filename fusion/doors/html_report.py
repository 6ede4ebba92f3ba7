"""``write_html``: one self-contained HTML page of a fusion run, for people to read.

The page holds the summary (per rule: matches fused, candidates rejected and
why, nodes matched -> nodes after, parameters added; the verification and
benchmark figures when the run has them), the near-misses, and two drawings:

* the ORIGINAL graph, each fused match boxed in its rule's colour (one colour
  per rule, with a legend) and each rejected anchor outlined in red, the reason
  as its tooltip;
* the FUSED graph, the nodes each match became tinted in the same colour.

Drawings come from Graphviz (``dot -Tsvg``) when it is installed, else from a
small layered layout of our own: rows are the longest path from the inputs,
edges that skip rows get bend points that take part in the ordering, and a
few barycentre sweeps untangle each row.  Parameter variables are folded into
the label of the op that reads them, so a ResNet-50 is ~180 boxes, not ~500.
Graphs over ``max_ops`` op nodes are drawn only around the fused regions.

The page has no script and no external resource, and is written as ASCII
(everything else as character references).  Every name is user data: all of
it is escaped, in the page and in what goes to Graphviz.
"""
from __future__ import annotations

import html
import re
import shutil
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import networkx as nx

from .about import describe_run
from ..ir.errors import FusionError
from ..ir.graph import Graph
from ..engine.report import group_reasons
from ..files.modelio import write_text_atomic

RENDERERS = ("auto", "dot", "svg")
MAX_OPS = 1500            # above this many op nodes, draw only the fused regions and their neighbours
DOT_TIMEOUT_S = 120
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7",
           "#17becf", "#bab0ac")
REJECTED = "#d62728"
_PARAM_SUFFIXES = ("_weight", "_bias", "_gamma", "_beta", "_moving_mean", "_moving_var",
                   "_running_mean", "_running_var")
_MAX_LABEL = 40
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


# ---------------------------------------------------------------- what to draw

@dataclass
class _Box:
    name: str
    kind: str                      # "op", "input" or "output"
    lines: List[str]
    tip: str
    region: Optional[int] = None   # index into _View.regions
    colour: Optional[int] = None   # palette index of the region's rule
    rejected: Optional[str] = None


@dataclass
class _View:
    boxes: List[_Box]
    edges: List[Tuple[int, int]]
    regions: List[Tuple[str, str, int]]   # (rule, anchor, palette index)
    op_count: int
    note: str = ""


def _clean(text: Any) -> str:
    return _CONTROL.sub("\ufffd", str(text))


def _esc(text: Any) -> str:
    return html.escape(_clean(text), quote=True)


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_LABEL else text[: _MAX_LABEL - 1] + "\u2026"


def _short(param: str, owner: str) -> str:
    return param[len(owner) + 1:] if param.startswith(owner + "_") and len(param) > len(owner) + 1 else param


def _param_names(graph: Graph, result: Any, inputs: Optional[Sequence[str]]) -> Set[str]:
    """Variables to fold into their reader's label: everything but the graph's data inputs."""
    variables = {nd.name for nd in graph.variables()}
    if inputs is not None:
        return variables - set(inputs)
    given = set(result.arg_params) | set(result.aux_params)
    kept = {nd.name for nd in result.graph.variables()}
    params = {v for v in variables if v in given or v not in kept}   # gone after fusion: folded away
    if not given:   # fused without parameters: only names tell
        params |= {v for v in variables if v.endswith(_PARAM_SUFFIXES)}
    return params


def _colours(report: Any) -> Dict[str, int]:
    fused_rules = [name for name, r in report.rules.items() if r.fused]
    return {name: k % len(PALETTE) for k, name in enumerate(fused_rules)}


def _marks(report: Any, colours: Dict[str, int], side: str):
    """Regions (rule, anchor, colour), node name -> region, and anchor -> rejection text, for one drawing."""
    regions: List[Tuple[str, str, int]] = []
    region_of: Dict[str, int] = {}
    rejected: Dict[str, str] = {}
    for name, rr in report.rules.items():
        for m in rr.fused:
            regions.append((name, m["anchor"], colours[name]))
            for n in m[side]:
                if side == "nodes":
                    region_of.setdefault(n, len(regions) - 1)   # a later pass may re-match a new node
                else:
                    region_of[n] = len(regions) - 1            # the last match made it
        if side == "nodes":
            for anchor, reason in rr.rejected.items():
                rejected[anchor] = (rejected[anchor] + "\n" if anchor in rejected else "") + \
                    "rejected by %s: %s" % (name, reason)
    return regions, region_of, rejected


def _neighbourhood(graph: Graph, core_names: Set[str]) -> Set[int]:
    """ids of the nodes named in ``core_names`` and of their producers and consumers."""
    users = graph.consumers()
    core = [nd for nd in graph.nodes if nd.name in core_names]
    keep = {id(nd) for nd in core}
    for nd in core:
        keep.update(id(e.node) for e in nd.inputs)
        keep.update(id(c) for c, _ in users.get(nd, ()))
    return keep


def _op_box(nd: Any, params: Set[str], region: Optional[int], regions, rejected: Optional[str]) -> _Box:
    own = [e.node.name for e in nd.inputs if e.node.is_variable and e.node.name in params]
    lines = [_cut(nd.name), _cut(nd.op)]
    if own:
        lines.append(_cut("+ " + ", ".join(_short(p, nd.name) for p in own)))
    tip = [nd.name, "op: " + nd.op] + ["%s=%s" % kv for kv in sorted(nd.attrs.to_json().items())]
    if own:
        tip.append("params: " + ", ".join(own))
    if region is not None:
        tip.append("fused by %s (anchor %s)" % regions[region][:2])
    if rejected:
        tip.append(rejected)
    return _Box(nd.name, "op", lines, "\n".join(tip), region,
                regions[region][2] if region is not None else None, rejected)


def _view(graph: Graph, params: Set[str], report: Any, colours: Dict[str, int], side: str,
          max_ops: int) -> _View:
    """Boxes and edges of ``graph``; ``side`` is "nodes" (original) or "new" (fused) of each match."""
    regions, region_of, rejected = _marks(report, colours, side)
    ops = graph.op_nodes()
    shown = [nd for nd in graph.nodes if not (nd.is_variable and nd.name in params)]
    note = ""
    if len(ops) > max_ops:
        keep = _neighbourhood(graph, set(region_of) | set(rejected))
        shown = [nd for nd in shown if id(nd) in keep]
        note = ("more than %d op nodes: only the fused regions%s and their immediate neighbours are drawn "
                "(%d of %d op nodes)" % (max_ops, " and rejected anchors" if side == "nodes" else "",
                                         sum(1 for nd in shown if not nd.is_variable), len(ops)))
    index: Dict[int, int] = {}
    boxes: List[_Box] = []
    for nd in shown:
        index[id(nd)] = len(boxes)
        boxes.append(_Box(nd.name, "input", [_cut(nd.name)], "input " + nd.name) if nd.is_variable else
                     _op_box(nd, params, region_of.get(nd.name), regions, rejected.get(nd.name)))
    edges = list(dict.fromkeys((index[id(e.node)], index[id(nd)]) for nd in shown for e in nd.inputs
                               if id(e.node) in index))
    for k, e in enumerate(graph.heads):
        if id(e.node) in index:
            boxes.append(_Box("output %d" % k, "output", ["output %d" % k],
                              "output %d: %s[%d]" % (k, e.node.name, e.index)))
            edges.append((index[id(e.node)], len(boxes) - 1))
    return _View(boxes, edges, regions, len(ops), note)


def _tint(colour: str, strength: float) -> str:
    """``colour`` mixed with white (strength 1: the colour itself)."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#%02x%02x%02x" % tuple(round(255 - (255 - c) * strength) for c in rgb)


# ---------------------------------------------------------------- Graphviz

class _DotFailed(Exception):
    pass


def _dq(text: str) -> str:
    # '&' first: Graphviz passes entity-like text through to the SVG unescaped
    return '"' + _clean(text).replace("&", "&amp;").replace("\\", "\\\\").replace('"', '\\"').replace(
        "\n", "\\n") + '"'


def _dot_svg(view: _View, dot: str) -> str:
    out = ['digraph G {',
           'graph [rankdir=TB, nodesep=0.18, ranksep=0.3, bgcolor="transparent", fontname="DejaVu Sans"];',
           'node [shape=box, style="rounded,filled", fillcolor="white", color="#555555", '
           'fontname="DejaVu Sans Mono", fontsize=10, margin="0.08,0.03", height=0.3];',
           'edge [color="#8a8a8a", arrowsize=0.6];']
    members: Dict[int, List[str]] = defaultdict(list)
    for i, b in enumerate(view.boxes):
        attrs = {"label": "\n".join(b.lines), "tooltip": b.tip}
        classes = [b.kind]
        if b.kind != "op":
            attrs.update(fillcolor="#eeeeee", color="#999999")
        if b.colour is not None:
            classes += ["fused", "r%d" % b.colour]
            attrs["fillcolor"] = _tint(PALETTE[b.colour], 0.45)
        if b.rejected:
            classes.append("rejected")
            attrs.update(color=REJECTED, penwidth="2", style="rounded,filled,dashed")
        attrs["class"] = " ".join(classes)
        line = "n%d [%s];" % (i, ", ".join("%s=%s" % (k, _dq(v)) for k, v in attrs.items()))
        (members[b.region] if b.region is not None else out).append(line)
    for r, lines in members.items():
        rule, anchor, c = view.regions[r]
        out.append('subgraph cluster_%d { label=%s; tooltip=%s; style="rounded,filled"; color="%s"; fillcolor="%s"; '
                   'fontsize=9; fontcolor="%s"; labeljust="l"; class="region r%d";'
                   % (r, _dq(rule), _dq("%s at %s" % (rule, anchor)), PALETTE[c], _tint(PALETTE[c], 0.15),
                      PALETTE[c], c))
        out.extend("  " + ln for ln in lines)
        out.append("}")
    out.extend("n%d -> n%d;" % e for e in view.edges)
    out.append("}")
    try:
        done = subprocess.run([dot, "-Tsvg"], input="\n".join(out).encode("utf-8"), capture_output=True,
                              timeout=DOT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _DotFailed(str(e)) from None
    if done.returncode != 0 or b"<svg" not in done.stdout:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise _DotFailed(said[-1] if said else "exit status %d, no SVG" % done.returncode)
    svg = done.stdout.decode("utf-8")
    return re.sub(r"<!--.*?-->", "", svg[svg.index("<svg"):], flags=re.S)


# ---------------------------------------------------------------- built-in layout

_FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
_LINE, _PAD, _HGAP, _VGAP, _DUMMY_W = 13, 6, 22, 34, 6
_MAX_SPAN = 8          # edges skipping more rows are drawn as one curve, without bend points


def _size(b: _Box) -> Tuple[float, float]:
    w = max(len(s) * (6.8 if i == 0 else 6.1) for i, s in enumerate(b.lines)) + 2 * _PAD + 4
    return max(w, 44.0), len(b.lines) * _LINE + 2 * _PAD


def _layout(view: _View):
    """Positions (centre x, top y) of boxes, the bend points of each edge, and the canvas size."""
    n = len(view.boxes)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(view.edges)
    layer = {v: k for k, gen in enumerate(nx.topological_generations(g)) for v in gen}
    for v in range(n):   # a graph input sits just above its first reader, not on the top row
        if view.boxes[v].kind == "input" and g.out_degree(v):
            layer[v] = min(layer[s] for s in g.successors(v)) - 1
    width = {v: _size(view.boxes[v])[0] for v in range(n)}
    up: Dict[int, List[int]] = defaultdict(list)
    down: Dict[int, List[int]] = defaultdict(list)
    chains, long_edges = [], []
    for u, v in view.edges:
        if layer[v] - layer[u] > _MAX_SPAN:
            long_edges.append((u, v))
            continue
        chain = [u]
        for k in range(layer[u] + 1, layer[v]):
            d = len(layer)
            layer[d], width[d] = k, _DUMMY_W
            chain.append(d)
        chain.append(v)
        for a, b in zip(chain, chain[1:]):
            down[a].append(b)
            up[b].append(a)
        chains.append(chain)
    rows: List[List[int]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for v in sorted(layer, key=lambda v: (layer[v], v)):
        rows[layer[v]].append(v)
    order = {v: i for row in rows for i, v in enumerate(row)}
    for _ in range(4):   # barycentre sweeps, down then up
        for row, nbrs in [(r, up) for r in rows[1:]] + [(r, down) for r in reversed(rows[:-1])]:
            row.sort(key=lambda v: sum(order[u] for u in nbrs[v]) / len(nbrs[v]) if nbrs[v] else order[v])
            order.update((v, i) for i, v in enumerate(row))
    x: Dict[int, float] = {}
    for row in rows:
        at = 0.0
        for v in row:
            x[v] = at + width[v] / 2
            at += width[v] + _HGAP
    for sweep in range(8):   # pull each node towards its neighbours, keeping the row's order
        seq = [(r, up) for r in rows[1:]] if sweep % 2 == 0 else [(r, down) for r in reversed(rows[:-1])]
        for row, nbrs in seq:
            want = [sum(x[u] for u in nbrs[v]) / len(nbrs[v]) if nbrs[v] else x[v] for v in row]
            x.update(zip(row, _place(row, want, width)))
    left = min((x[v] - width[v] / 2 for v in x), default=0.0)
    margin = 24.0
    for v in x:
        x[v] += margin - left
    heights = [max([_size(view.boxes[v])[1] for v in row if v < n] or [0]) for row in rows]
    tops, y = [], margin + 10
    for h in heights:
        tops.append(y)
        y += h + _VGAP
    top = {v: tops[layer[v]] + (heights[layer[v]] - (_size(view.boxes[v])[1] if v < n else 0)) / 2 for v in x}
    size = (max((x[v] + width[v] / 2 for v in x), default=0) + margin, y - _VGAP + margin)
    return x, top, tops, heights, layer, chains, long_edges, size


def _place(row: List[int], want: List[float], width: Dict[int, float]) -> List[float]:
    """Positions closest to ``want`` that keep ``row``'s order and spacing: the mean of a left and a right pass."""
    def gap(a, b):   # bend points keep clear of boxes and of the frames drawn around fused regions
        boxes = (width[a] > _DUMMY_W) + (width[b] > _DUMMY_W)
        return (width[a] + width[b]) / 2 + (_HGAP, 18, 8)[2 - boxes]

    lo, hi = list(want), list(want)
    for i in range(1, len(row)):
        lo[i] = max(want[i], lo[i - 1] + gap(row[i - 1], row[i]))
    for i in range(len(row) - 2, -1, -1):
        hi[i] = min(want[i], hi[i + 1] - gap(row[i], row[i + 1]))
    return [(a + b) / 2 for a, b in zip(lo, hi)]


def _own_svg(view: _View, prefix: str) -> str:
    n = len(view.boxes)
    x, top, tops, heights, layer, chains, long_edges, (W, H) = _layout(view)

    def bottom(v):
        return top[v] + _size(view.boxes[v])[1]

    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
           'font-family="%s" class="drawing">' % (W, H, W, H, _FONT),
           '<defs><marker id="%s-arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#8a8a8a"/></marker></defs>' % prefix]
    members: Dict[int, List[int]] = defaultdict(list)
    for v in range(n):
        if view.boxes[v].region is not None:
            members[view.boxes[v].region].append(v)
    # region backgrounds, then edges over them, then the boxes (each match's boxes in one group)
    for r, vs in members.items():
        rule, anchor, c = view.regions[r]
        x0 = min(x[v] - _size(view.boxes[v])[0] / 2 for v in vs) - 8
        x1 = max(x[v] + _size(view.boxes[v])[0] / 2 for v in vs) + 8
        y0, y1 = min(top[v] for v in vs) - 17, max(bottom(v) for v in vs) + 7
        out.append('<g class="region-box r%d"><title>%s</title>' % (c, _esc("%s at %s" % (rule, anchor))))
        out.append('<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" rx="7" fill="%s" stroke="%s" '
                   'stroke-width="1.5"/>' % (x0, y0, x1 - x0, y1 - y0, _tint(PALETTE[c], 0.16), PALETTE[c]))
        out.append('<text x="%.1f" y="%.1f" font-size="9.5" fill="%s">%s</text></g>'
                   % (x0 + 5, y0 + 11, PALETTE[c], _esc(rule)))
    for chain in chains:
        pts = [(x[chain[0]], bottom(chain[0]))]
        for d in chain[1:-1]:
            pts += [(x[d], tops[layer[d]]), (x[d], tops[layer[d]] + heights[layer[d]])]
        pts.append((x[chain[-1]], top[chain[-1]]))
        out.append(_edge_path(pts, prefix, ""))
    for u, v in long_edges:
        out.append(_edge_path([(x[u], bottom(u)), (x[v], top[v])], prefix, " long"))
    for r, vs in members.items():
        rule, anchor, c = view.regions[r]
        out.append('<g class="region r%d" data-rule="%s" data-anchor="%s">' % (c, _esc(rule), _esc(anchor)))
        out.extend(_box_svg(view.boxes[v], x[v], top[v]) for v in vs)
        out.append("</g>")
    out.extend(_box_svg(view.boxes[v], x[v], top[v]) for v in range(n) if view.boxes[v].region is None)
    out.append("</svg>")
    return "\n".join(out)


def _edge_path(pts, prefix: str, cls: str) -> str:
    d = ["M%.1f,%.1f" % pts[0]]
    for (ax, ay), (bx, by) in zip(pts, pts[1:]):
        if ax == bx:
            d.append("L%.1f,%.1f" % (bx, by))
        else:
            mid = (ay + by) / 2
            d.append("C%.1f,%.1f %.1f,%.1f %.1f,%.1f" % (ax, mid, bx, mid, bx, by))
    return ('<path class="edge%s" d="%s" fill="none" stroke="#8a8a8a" stroke-width="1.1"%s '
            'marker-end="url(#%s-arrow)"/>'
            % (cls, " ".join(d), ' stroke-dasharray="4 3" opacity="0.6"' if cls else "", prefix))


def _box_svg(b: _Box, cx: float, y: float) -> str:
    w, h = _size(b)
    classes = ["node", b.kind] + (["fused", "r%d" % b.colour] if b.colour is not None else []) + (
        ["rejected"] if b.rejected else [])
    if b.kind == "op":
        fill = _tint(PALETTE[b.colour], 0.45) if b.colour is not None else "#ffffff"
        stroke, rx = "#555555", 4
    else:
        fill, stroke, rx = "#eeeeee", "#999999", h / 2
    dash = ""
    if b.rejected:
        stroke, dash = REJECTED, ' stroke-dasharray="5 3" stroke-width="2"'
    out = ['<g class="%s" data-name="%s"><title>%s</title>' % (" ".join(classes), _esc(b.name), _esc(b.tip)),
           '<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" rx="%.1f" fill="%s" stroke="%s"%s/>'
           % (cx - w / 2, y, w, h, rx, fill, stroke, dash),
           '<text text-anchor="middle">']
    for i, line in enumerate(b.lines):
        style = ' font-size="11" font-weight="bold"' if i == 0 else ' font-size="10" fill="#555555"'
        out.append('<tspan x="%.1f" y="%.1f"%s>%s</tspan>' % (cx, y + _PAD + (i + 1) * _LINE - 3, style, _esc(line)))
    out.append("</text>")
    if b.rejected:
        out.append('<circle cx="%.1f" cy="%.1f" r="6" fill="%s"/><text x="%.1f" y="%.1f" font-size="9" '
                   'font-weight="bold" fill="#ffffff" text-anchor="middle">!</text>'
                   % (cx + w / 2, y, REJECTED, cx + w / 2, y + 3.2))
    out.append("</g>")
    return "\n".join(out)


# ---------------------------------------------------------------- the page

def _draw(view: _View, renderer: str, prefix: str) -> Tuple[str, str]:
    """(svg, note on how it was drawn)."""
    if not view.boxes:
        return "", "nothing to draw"
    dot = shutil.which("dot") if renderer in ("auto", "dot") else None
    if renderer == "dot" and not dot:
        raise FusionError("renderer='dot' needs Graphviz's dot binary on PATH")
    if dot:
        try:
            return _dot_svg(view, dot), "drawn by Graphviz dot"
        except _DotFailed as e:
            return _own_svg(view, prefix), "Graphviz failed (%s); drawn by the built-in layout" % e
    return _own_svg(view, prefix), "drawn by the built-in layout (Graphviz not used)"


def _num(value: Any, fmt: str) -> str:
    try:
        return fmt % value
    except (TypeError, ValueError):
        return "-"


def _summary(report: Any) -> List[str]:
    out = ['<p class="meta">mode <b>%s</b> &middot; <b>%d</b> fused &middot; ops %d &rarr; %d &middot; nodes %d &rarr; '
           '%d &middot; parameters removed %d &middot; %d pass(es) &middot; %s s</p>'
           % (_esc(report.mode), report.fused_count, report.ops_before, report.ops_after, report.nodes_before,
              report.nodes_after, report.params_removed, report.passes, _num(report.seconds, "%.3f"))]
    out.append('<p class="meta run">%s</p>' % "<br>".join(_esc(line) for line in describe_run(report)))
    v = report.extra.get("verify")
    if v:
        ok = bool(v.get("ok"))
        out.append('<p class="verify %s">Verification: max abs error %s, max rel error %s (tolerance %s): <b>%s</b></p>'
                   % ("ok" if ok and not v.get("problems") else "bad", _num(v.get("max_abs"), "%.3g"),
                      _num(v.get("max_rel"), "%.3g"), _num(v.get("rtol"), "%.3g"),
                      _esc(v.get("status") or ("OK" if ok else "MISMATCH"))))
        out.extend('<p class="verify bad">%s</p>' % _esc(p) for p in v.get("problems") or ())
        out.extend('<p>%s</p>' % _esc(d) for d in v.get("details") or ())
    b = report.extra.get("benchmark")
    if b:
        p10, p90 = b.get("p10_ms") or {}, b.get("p90_ms") or {}
        cells = "".join("<tr><td>%s</td><td class=n>%s</td><td class=n>%s</td><td class=n>%s</td></tr>"
                        % (_esc(k), _num(ms, "%.3f"), _num(p10.get(k), "%.3f"), _num(p90.get(k), "%.3f"))
                        for k, ms in (b.get("median_ms") or {}).items())
        out.append('<h2>Benchmark</h2><table><tr><th>graph</th><th>median ms</th><th>p10</th><th>p90</th></tr>%s'
                   '</table><p>speed-up, like for like: <b>%sx</b> with MXNet\'s oneDNN subgraph backend on (its '
                   'default bind), <b>%sx</b> with it off on both; fused (backend on) vs original with it off: %sx</p>'
                   % (cells, _num(b.get("speedup_vs_mxnet_default"), "%.2f"),
                      _num(b.get("speedup_both_subgraph_off"), "%.2f"), _num(b.get("speedup_vs_subgraph_off"), "%.2f")))
        out.extend('<p class="verify bad">Warning: %s</p>' % _esc(w) for w in b.get("warnings") or ())
    return out


def _rule_tables(report: Any, colours: Dict[str, int]) -> List[str]:
    out = ["<h2>Rules</h2><table><tr><th>rule</th><th>fused</th><th>rejected</th><th>nodes matched &rarr; after</th>"
           "<th>nodes removed</th><th>params added</th><th>what it does</th></tr>"]
    for name, r in report.rules.items():
        swatch = ('<span class="sw" style="background:%s"></span>' % PALETTE[colours[name]]) if name in colours else ""
        busy = r.fused or r.rejected or r.near_misses
        out.append('<tr%s><td>%s%s</td><td class=n>%d</td><td class=n>%d</td><td class=n>%d &rarr; %d</td>'
                   '<td class=n>%d</td><td class=n>%d</td><td>%s</td></tr>'
                   % ("" if busy else ' class="idle"', swatch, _esc(name), len(r.fused), len(r.rejected),
                      sum(len(m["nodes"]) for m in r.fused), sum(len(m["new"]) for m in r.fused),
                      r.nodes_removed, r.params_added, _esc(r.description)))
    out.append("</table>")
    for title, attr, cls in (("Rejected", "rejected", "rejected"), ("Near-misses", "near_misses", "near")):
        rows = []
        for name, r in report.rules.items():
            if attr == "near_misses":     # one row per kind of reason, the places counted
                by_reason: Dict[str, List[str]] = dict(group_reasons(r.near_misses))
            else:
                by_reason = defaultdict(list)
                for anchor, reason in r.rejected.items():
                    by_reason[reason].append(anchor)
            for reason, anchors in by_reason.items():
                shown = ("%d&times;: " % len(anchors) if len(anchors) > 1 else "") + ", ".join(
                    _esc(a) for a in anchors[:10]) + (" (+%d more)" % (len(anchors) - 10) if len(anchors) > 10 else "")
                rows.append("<tr><td>%s</td><td>%s</td><td>%s</td></tr>" % (_esc(name), shown, _esc(reason)))
        out.append('<h2>%s</h2>' % title)
        out.append('<table class="%s"><tr><th>rule</th><th>anchor</th><th>reason</th></tr>%s</table>'
                   % (cls, "".join(rows)) if rows else "<p>none</p>")
    if report.notes:
        out.append("<h2>Notes</h2><ul>%s</ul>" % "".join("<li>%s</li>" % _esc(n) for n in report.notes))
    return out


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:20px;color:#222}
h1{font-size:22px;margin:0 0 6px}h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;margin:4px 0}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.idle td{color:#999}td:first-child{white-space:nowrap}.meta{color:#444}
.verify{padding:6px 10px;border-radius:4px;display:inline-block}
.verify.ok{background:#e5f4e3}.verify.bad{background:#fbe3e3}table.rejected td:last-child{color:#a01c1c}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:6px;vertical-align:-1px;
border:1px solid rgba(0,0,0,.25)}.legend span.item{margin-right:16px;white-space:nowrap}
.rej{display:inline-block;width:12px;height:10px;border:2px dashed #d62728;border-radius:3px;margin-right:6px}
.graphs{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
.panel{flex:1 1 420px;min-width:0;border:1px solid #ddd;border-radius:6px;padding:8px}
.panel h3{margin:0 0 4px;font-size:15px}.panel .how{color:#777;font-size:12px;margin:0 0 6px}
.canvas{overflow:auto;max-height:1600px}.canvas svg{display:block}
"""


def render_html(original_graph: Any, result: Any, *, title: Optional[str] = None, renderer: str = "auto",
                inputs: Optional[Sequence[str]] = None, max_ops: int = MAX_OPS) -> str:
    """The page as text (ASCII).  See :func:`write_html`."""
    if renderer not in RENDERERS:
        raise ValueError("renderer must be one of %s, not %r" % (", ".join(RENDERERS), renderer))
    graph = original_graph if isinstance(original_graph, Graph) else Graph.from_symbol(original_graph)
    report = result.report
    colours = _colours(report)
    params = _param_names(graph, result, inputs)
    fused_params = params | set(result.arg_params) | set(result.aux_params)
    panels = []
    for label, g, side, prm, prefix in (("Original graph", graph, "nodes", params, "orig"),
                                        ("Fused graph", result.graph, "new", fused_params, "fused")):
        view = _view(g, prm, report, colours, side, max_ops)
        svg, how = _draw(view, renderer, prefix)
        notes = "".join('<p class="how">%s</p>' % _esc(t) for t in (view.note, how) if t)
        panels.append('<div class="panel %s"><h3>%s (%d op nodes)</h3>%s<div class="canvas">%s</div></div>'
                      % (prefix, label, view.op_count, notes, svg))
    legend = ['<p class="legend">']
    legend += ['<span class="item"><span class="sw" style="background:%s"></span>%s (%d)</span>'
               % (_tint(PALETTE[c], 0.45), _esc(name), len(report.rules[name].fused)) for name, c in colours.items()]
    legend.append('<span class="item"><span class="rej"></span>rejected anchor (hover for the reason)</span></p>')
    heading = title if title is not None else "mxnet-fusion report"
    page = (['<!DOCTYPE html>', '<html lang="en"><head><meta charset="utf-8">',
             '<title>%s</title><style>%s</style></head><body>' % (_esc(heading), _CSS),
             '<h1>%s</h1>' % _esc(heading)]
            + _summary(report) + _rule_tables(report, colours)
            + ['<h2>Graphs</h2>'] + legend + ['<div class="graphs">'] + panels + ['</div></body></html>'])
    return "\n".join(page).encode("ascii", "xmlcharrefreplace").decode("ascii")


def write_html(path: str, original_graph: Any, result: Any, *, title: Optional[str] = None, renderer: str = "auto",
               inputs: Optional[Sequence[str]] = None, max_ops: int = MAX_OPS, protect: Sequence[str] = ()) -> None:
    """Write one self-contained HTML page about ``result`` (a FusionResult of ``original_graph``).

    ``original_graph`` is the Graph (or Symbol) that was fused.  ``renderer``: "dot" (Graphviz,
    an error without it), "svg" (the built-in layout) or "auto" (dot when installed).  ``inputs``
    names the graph's data inputs; by default every variable the fused graph does not hold as a
    parameter is one.  Graphs of more than ``max_ops`` op nodes are drawn only around the fused
    regions.  The file is written atomically and never over a path in ``protect``.
    """
    write_text_atomic(path, render_html(original_graph, result, title=title, renderer=renderer, inputs=inputs,
                                        max_ops=max_ops), protect=protect)
