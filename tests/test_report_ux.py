"""What mxfuse tells a person: --list-rules, --version, what a report records, the README's rule table."""
import json
import os
import re

import mxnet as mx
import pytest

import fusion
from fusion import cli
from patterns import FAMILIES, default_rules, rules_by_name

from conftest import random_params, small_cnn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(capsys, *argv):
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_family_and_a_rule_never_share_a_name():
    rule_names = [r.name for r in default_rules()]
    assert len(set(rule_names)) == len(rule_names)
    assert not set(FAMILIES) & set(rule_names)
    known = rules_by_name()
    assert [r.name for r in known["attention"]] == ["attention"]        # the rule, as the report names it
    assert [r.name for r in known["conv_bn_act"]] == ["conv_bn_act"]
    assert [r.name for r in known["bn_folding"]] == ["conv_bn_add_act", "conv_bn_act", "conv_bn", "dense_bn"]
    assert "attention_interleaved" in [r.name for r in known["attention_fusion"]]


def test_readme_rule_table_lists_every_rule_with_its_family():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    table = text[text.index("| rule | family | file |"):]
    table = table[: table.index("\n\n")]
    rows = [[c.strip().strip("`") for c in ln.strip("|").split("|")] for ln in table.splitlines()[2:]]
    listed = {row[0]: row[1] for row in rows}
    from patterns import family_of

    assert listed == {r.name: family_of(r.name) or "–" for r in default_rules()}


def test_list_rules_and_version(capsys):
    code, out, err = run_cli(capsys, "--list-rules")
    assert code == 0 and not err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["rule", "family", "mode"]
    by_rule = {ln.split()[0]: ln for ln in lines[1:] if ln.strip() and not ln.startswith("--rules")}
    assert set(by_rule) == {r.name for r in default_rules()}
    assert re.match(r"dense_bn +bn_folding +inference only +fold BatchNorm", by_rule["dense_bn"])
    assert re.match(r"attention_heads +attention_fusion +inference and training ", by_rule["attention_heads"])
    code, out, err = run_cli(capsys, "--version")
    assert code == 0 and out == "mxfuse %s (MXNet %s, Python %s)\n" % (
        fusion.__version__, mx.__version__, __import__("platform").python_version())


def test_report_records_versions_shapes_and_command_line(tmp_model, tmp_path, capsys):
    sp, pp = tmp_model()
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    code, _, err = run_cli(capsys, sp, "--params", pp, "-o", str(tmp_path / "out") + "/", "--shape", "data=1,3,8,8",
                           "--report", report, "--html", page, "--quiet")
    assert code == 0, err
    d = json.loads(report.read_text())
    assert d["versions"] == {"mxnet_fusion": fusion.__version__, "mxnet": mx.__version__,
                             "python": __import__("platform").python_version()}
    assert d["input_shapes"] == {"data": [1, 3, 8, 8]}
    assert d["command_line"] == "mxfuse %s --params %s -o %s/ --shape data=1,3,8,8 --report %s --html %s --quiet" % (
        sp, pp, tmp_path / "out", report, page)
    html = page.read_text()
    assert "MXNet %s" % mx.__version__ in html and "input shapes: data=1,3,8,8" in html
    assert "command: mxfuse " in html


def test_batch_reports_record_the_batch_command(tmp_path):
    import io

    from fusion import batch

    sym = small_cnn()
    arg, aux = random_params(sym, {"data": (1, 3, 8, 8)})
    sym.save(str(tmp_path / "m-symbol.json"))
    mx.nd.save(str(tmp_path / "m-0000.params"), {**{"arg:" + k: v for k, v in arg.items()},
                                                  **{"aux:" + k: v for k, v in aux.items()}})
    argv = [str(tmp_path / "m-symbol.json"), str(tmp_path / "m-symbol.json"), "-o", str(tmp_path / "out"),
            "--reports", "--shape", "data=1,3,8,8"]
    assert batch.main_batch(argv, stdout=io.StringIO(), stderr=io.StringIO()) == 0
    d = json.loads((tmp_path / "out" / "m-report.json").read_text())
    assert d["command_line"] == "mxfuse " + " ".join(argv) and d["input_shapes"] == {"data": [1, 3, 8, 8]}


@pytest.mark.parametrize("name", ["attention_fusion", "bn_folding", "inference_cleanup", "gelu", "conv_bn"])
def test_rules_option_takes_family_and_rule_names(name):
    sym = small_cnn()
    res = fusion.fuse(sym, rules=[name])
    assert set(res.report.rules) <= {r.name for r in rules_by_name()[name]}
