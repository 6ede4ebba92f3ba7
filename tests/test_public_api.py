"""The public API for rule authors (fusion.rules): a rule module written against it loads and fires, and so
does one written against the package's former paths (fusion.pattern, fusion.rule), with a DeprecationWarning."""
import sys
import textwrap
import warnings

import mxnet as mx
import numpy as np
import pytest

import fusion
from fusion.api import load_user_rules

from conftest import run_mxfuse

BODY = '''
class DoubleRelu(Rule):
    """relu(x) * 2 -> relu(x * 2) (exact: scaling by 2 commutes with relu)."""
    name = "double_relu"
    benefit = 5
    description = "relu(x) * 2 -> relu(x * 2)"

    def pattern(self):
        return scalar("mul", op.relu(Var("x"), name="r"), name="s", scalar=2.0)

    def check(self, m):
        return None

    def rewrite(self, m, b):
        return b.op("relu", [b.op("_mul_scalar", [m["x"]], attrs={"scalar": 2.0})])


RULES = [DoubleRelu()]
'''

MODULES = {
    "rules_public": "from fusion.rules import Rule, Var, op, scalar\n",
    "rules_old_paths": "from fusion.pattern import Var, op, scalar\nfrom fusion.rule import Rule\n",
}


@pytest.fixture
def rule_dir(tmp_path, monkeypatch):
    for name, imports in MODULES.items():
        (tmp_path / (name + ".py")).write_text(imports + textwrap.dedent(BODY))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in MODULES:
        sys.modules.pop(name, None)


def _graph():
    x = mx.sym.Variable("data")
    return mx.sym.relu(x, name="r") * 2.0


@pytest.mark.parametrize("module,deprecated", [("rules_public", False), ("rules_old_paths", True)])
def test_rule_modules_load_and_fire(rule_dir, module, deprecated):
    sys.modules.pop("fusion.pattern", None)
    sys.modules.pop("fusion.rule", None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rules = load_user_rules(module + ":RULES")
    moved = [w for w in seen if issubclass(w.category, DeprecationWarning) and "fusion.rules" in str(w.message)]
    assert bool(moved) == deprecated, [str(w.message) for w in seen]
    if deprecated:
        assert "fusion.pattern moved" in str(moved[0].message) and moved[0].filename.endswith("rules_old_paths.py")
    res = fusion.fuse(_graph(), {}, {}, rules=rules, input_shapes={"data": (2, 3)})
    assert res.report.fused_count == 1
    x = mx.nd.array(np.random.default_rng(0).standard_normal((2, 3)))
    want = _graph().eval(data=x)[0].asnumpy()
    got = res.symbol.eval(data=x)[0].asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_old_paths_are_the_new_modules(rule_dir):
    import fusion.rules as public
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fusion.pattern as old_pattern
        import fusion.rule as old_rule
    assert old_pattern.Var is public.Var and old_rule.Rule is public.Rule is fusion.Rule
    for name in public.__all__:
        assert getattr(public, name) is not None


def test_mxfuse_takes_a_rule_module_written_against_the_public_api(rule_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(rule_dir)
    sp = tmp_path / "m-symbol.json"
    _graph().save(str(sp))
    code, out, err = run_mxfuse(capsys, sp, "-o", tmp_path / "o", "--rules", "rules_public:RULES",
                                "--shape", "data=2,3", "--verify")
    assert code == 0, err
    assert "double_relu" in out and "OK" in out
