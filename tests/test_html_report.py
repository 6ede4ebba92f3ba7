"""HTML report: summary, reasons and fused regions on the page; both drawings; rendered by headless Chromium."""
import html.parser
import shutil
import struct
import subprocess

import mxnet as mx
import pytest

import fusion
from fusion.doors import html_report
from fusion.ir.errors import FusionError
from fusion.ir.graph import Graph

from conftest import random_params

X = {"data": (1, 3, 8, 8)}
ODD = 'conv2<&>'          # names are user data: the page must escape them
ODD_BN = 'bn2 "x"'


def cnn():
    """Conv-BN-ReLU, Conv-BN + residual add + ReLU, and a Conv-BN whose conv output is shared (rejected)."""
    x = mx.sym.var("data")
    a = mx.sym.Convolution(x, num_filter=8, kernel=(3, 3), pad=(1, 1), name="conv0")
    a = mx.sym.Activation(mx.sym.BatchNorm(a, fix_gamma=False, name="bn0"), act_type="relu", name="relu0")
    b = mx.sym.BatchNorm(mx.sym.Convolution(a, num_filter=8, kernel=(3, 3), pad=(1, 1), name="conv1"),
                         fix_gamma=False, name="bn1")
    r = mx.sym.Activation(b + a, act_type="relu", name="res_relu")
    c = mx.sym.Convolution(r, num_filter=8, kernel=(1, 1), name=ODD)
    pooled = mx.sym.Pooling(mx.sym.BatchNorm(c, name=ODD_BN), kernel=(1, 1), global_pool=True, pool_type="avg",
                            name="pool")
    return mx.sym.Group([mx.sym.Flatten(pooled, name="flat"), mx.sym.relu(c, name="side_relu")])


@pytest.fixture(scope="module")
def fused():
    sym = cnn()
    arg, aux = random_params(sym, X)
    res = fusion.fuse(sym, arg, aux, rules=["bn_folding"])
    fused_rules = [r for r, rr in res.report.rules.items() if rr.fused]
    assert sorted(fused_rules) == ["conv_bn_act", "conv_bn_add_act"], res.report.to_text()
    assert ODD_BN in res.report.rules["conv_bn"].rejected
    return sym, res


class Page(html.parser.HTMLParser):
    """Every element with its classes, attributes, parent, and the text and attribute values inside it."""

    VOID = {"meta", "br", "hr", "img", "link", "input"}

    def __init__(self, text):
        super().__init__()
        self.stack, self.elements = [], []
        self.feed(text)
        self.close()
        assert not self.stack, "unclosed: %s" % [f["tag"] for f in self.stack]

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        frame = {"tag": tag, "attrs": a, "cls": set((a.get("class") or "").split()), "text": [],
                 "inner": [v for v in a.values() if v], "parent": self.stack[-1] if self.stack else None}
        self.elements.append(frame)
        if tag not in self.VOID:
            self.stack.append(frame)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        frame = self.stack.pop()
        assert frame["tag"] == tag, "</%s> closes <%s>" % (tag, frame["tag"])
        if self.stack:
            self.stack[-1]["text"] += frame["text"]
            self.stack[-1]["inner"] += frame["inner"]

    def handle_data(self, data):
        if self.stack:
            self.stack[-1]["text"].append(data)

    def find(self, tag=None, cls=(), inside=None):
        return [e for e in self.elements if (tag is None or e["tag"] == tag) and set(cls) <= e["cls"]
                and (inside is None or is_inside(e, inside))]


def is_inside(e, outer):
    while e is not None:
        e = e["parent"]
        if e is outer:
            return True
    return False


def names(elements):
    return [e["attrs"]["data-name"] for e in elements]


def text(e):
    return "".join(e["text"])


def label(page, node):
    """A Graphviz node's name: the first line of its label."""
    return text(page.find("text", inside=node)[0])


def check_common(page_text, res):
    page = Page(page_text)
    assert page_text.isascii()
    # self-contained: no script, no external resource (the SVG namespaces are names, not downloads)
    lowered = page_text.lower()
    assert "<script" not in lowered and "<link" not in lowered and "src=" not in lowered and "@import" not in lowered
    assert lowered.count("http") == lowered.count("http://www.w3.org/")
    # names are escaped: the raw markup never appears, the parsed text has it verbatim
    assert ODD not in page_text and "conv2&lt;&amp;&gt;" in page_text
    body = text(page.find("body")[0])
    reason = res.report.rules["conv_bn"].rejected[ODD_BN]
    assert ODD in reason and reason in body
    rejected_table = page.find("table", ["rejected"])[0]
    assert ODD_BN in text(rejected_table) and reason in text(rejected_table)
    rules_text = text(page.find("table")[0])
    assert "conv_bn_add_act" in rules_text and "4 \u2192 3" in rules_text
    return page


def test_page_with_built_in_layout(fused, tmp_path):
    sym, res = fused
    path = tmp_path / "report.html"
    html_report.write_html(str(path), Graph.from_symbol(sym), res, title="tiny <cnn>", renderer="svg")
    page = check_common(path.read_text(), res)
    assert text(page.find("title")[0]) == "tiny <cnn>"
    orig, new = page.find("div", ["panel"])
    assert "built-in layout" in text(orig)
    # each match is one highlighted group holding exactly its nodes, in its rule's colour
    matches = [(rule, m) for rule, rr in res.report.rules.items() for m in rr.fused]
    for rule, m in matches:
        groups = [g for g in page.find("g", ["region"], inside=orig) if g["attrs"]["data-anchor"] == m["anchor"]]
        assert len(groups) == 1 and groups[0]["attrs"]["data-rule"] == rule
        assert sorted(names(page.find("g", ["node", "fused"], inside=groups[0]))) == sorted(m["nodes"])
    assert len(page.find("g", ["region"], inside=orig)) == len(matches)
    assert len({c for g in page.find("g", ["region"]) for c in g["cls"]} - {"region"}) == 2   # a colour per rule
    # the rejected anchor is marked, with the reason as its tooltip
    rej = page.find("g", ["rejected"])
    assert names(rej) == [ODD_BN] and res.report.rules["conv_bn"].rejected[ODD_BN] in text(rej[0])
    # parameters are folded into their reader's label, not drawn as boxes
    drawn = names(page.find("g", ["node"], inside=orig))
    assert "conv0_weight" not in drawn and {"data", "side_relu", "output 0", "output 1"} <= set(drawn)
    assert text(page.find("g", ["node"], inside=orig)[drawn.index("conv0")]).strip().endswith("+ weight, bias")
    # the fused graph: the nodes the matches became, tinted
    assert set(names(page.find("g", ["fused"], inside=new))) == {n for _, m in matches for n in m["new"]}
    assert "BatchNorm" not in text(page.find("g", ["fused"], inside=new)[0])


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed")
def test_page_with_graphviz(fused, tmp_path):
    sym, res = fused
    path = tmp_path / "report.html"
    html_report.write_html(str(path), Graph.from_symbol(sym), res, renderer="dot")
    page = check_common(path.read_text(), res)
    assert "Graphviz dot" in text(page.find("div", ["panel"])[0])
    clusters = page.find("g", ["cluster"])
    n_matches = sum(len(rr.fused) for rr in res.report.rules.values())
    assert len(clusters) == 2 * n_matches           # original and fused drawing
    orig = page.find("div", ["panel"])[0]
    assert sorted(label(page, g) for g in page.find("g", ["fused"], inside=orig)) == sorted(
        n for rr in res.report.rules.values() for m in rr.fused for n in m["nodes"])
    rej = page.find("g", ["rejected"])
    assert len(rej) == 1 and label(page, rej[0]) == ODD_BN
    assert any(res.report.rules["conv_bn"].rejected[ODD_BN] in v for v in rej[0]["inner"])   # the tooltip


def test_without_graphviz_the_built_in_layout_is_used(fused, monkeypatch):
    sym, res = fused
    monkeypatch.setattr(html_report.shutil, "which", lambda name: None)
    page = html_report.render_html(Graph.from_symbol(sym), res)          # renderer="auto"
    assert page.count("drawn by the built-in layout") == 2 and "<g class=\"region" in page
    with pytest.raises(FusionError, match="dot"):
        html_report.render_html(Graph.from_symbol(sym), res, renderer="dot")
    monkeypatch.setattr(html_report.shutil, "which", lambda name: "/bin/false")     # a dot that fails
    page = html_report.render_html(Graph.from_symbol(sym), res, renderer="dot")
    assert page.count("Graphviz failed (exit status 1, no SVG); drawn by the built-in layout") == 2


def test_large_graph_draws_fused_regions_and_neighbours_only(fused):
    sym, res = fused
    page = Page(html_report.render_html(Graph.from_symbol(sym), res, renderer="svg", max_ops=5))
    orig = page.find("div", ["panel"])[0]
    assert "only the fused regions and rejected anchors and their immediate neighbours" in text(orig)
    drawn = set(names(page.find("g", ["node"], inside=orig)))
    assert {"conv0", "bn0", "relu0", "conv1", "bn1", "res_relu", ODD, ODD_BN, "pool"} <= drawn
    assert "side_relu" not in drawn and "flat" not in drawn      # two steps away from any region


def test_figures_and_unfused_graph(tmp_path):
    sym = cnn()
    res = fusion.fuse(sym, rules=["bn_folding"])      # no params: nothing folds, every BatchNorm says why
    res.report.extra["verify"] = {"max_abs": 1e-6, "max_rel": 2e-3, "rtol": 1e-4, "ok": False}
    res.report.extra["benchmark"] = {"median_ms": {"original": 2.0, "fused": 1.0},
                                     "speedup_vs_mxnet_default": 2.0, "speedup_vs_subgraph_off": 1.5}
    page = Page(html_report.render_html(sym, res, renderer="svg"))
    body = text(page.find("body")[0])
    assert "MISMATCH" in body and "like for like: 2.00x with MXNet's oneDNN subgraph backend on" in body and "1.50x" in body
    assert "needs the parameter values" in body
    drawn = set(names(page.find("g", ["node"])))
    assert "conv0_weight" not in drawn and "bn0_moving_var" not in drawn and "data" in drawn
    anchors = {a for rr in res.report.rules.values() for a in rr.rejected}
    assert {"bn0", "bn1", ODD_BN} <= anchors
    assert sorted(names(page.find("g", ["rejected"]))) == sorted(anchors)      # marked in the original only


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_renders_in_headless_chromium(fused, tmp_path):
    browser = find_chromium()
    if browser is None:
        pytest.skip("no Chromium binary on PATH (Debian package 'chromium')")
    sym, res = fused
    page, png = tmp_path / "report.html", tmp_path / "report.png"
    html_report.write_html(str(page), Graph.from_symbol(sym), res, title="tiny cnn")
    done = subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage",
                           "--hide-scrollbars", "--user-data-dir=%s" % (tmp_path / "profile"),
                           "--screenshot=%s" % png, "--window-size=1400,1800", page.as_uri()],
                          capture_output=True, timeout=120)
    assert done.returncode == 0 and png.is_file(), done.stderr.decode(errors="replace")[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 1800)
    assert len(data) > 40_000        # a blank or error page compresses to a few kB; this page is ~200 kB
