"""fusion/engine/cost.py: cost tables (schema, lookup per device kind) and the decisions rules take from them;
the elementwise rule's layout-reorder decision on the CPU."""
import json
import os

import mxnet as mx
import pytest

import fusion
from fusion.engine import cost

from conftest import fuse_and_check, ops, random_params

S = mx.sym


def table(entries, kind="cpu", device=None, flags=None):
    here, here_flags = cost.cpu_identity()
    t = {"device": device or (here if kind == "cpu" else "NVIDIA H200"), "kind": kind, "date": "2026-01-01",
         "command": "python tools/measure_cpu_costs.py", "entries": entries}
    if kind == "cpu":
        t["cpu_flags"] = list(here_flags if flags is None else flags)
    return t


def entry(op, case, fused, unfused, dtype="float32", pass_="forward"):
    return {"op": op, "dtype": dtype, "pass": pass_, "case": case, "fused_ms": fused, "unfused_ms": unfused,
            "reference": "MXNet default bind"}


@pytest.fixture
def tables_dir(tmp_path, monkeypatch):
    """A folder of cost tables that wins over the shipped ones (MXFUSION_COST_TABLES)."""
    monkeypatch.setenv("MXFUSION_COST_TABLES", str(tmp_path))
    monkeypatch.setattr(cost, "TABLES_DIR", str(tmp_path / "shipped"))     # not this CPU's shipped table
    monkeypatch.delenv("MXFUSION_NO_COST", raising=False)
    cost._tables.cache_clear()
    yield tmp_path
    cost._tables.cache_clear()


def write(folder, t, name="t.json"):
    (folder / name).write_text(json.dumps(t))
    cost._tables.cache_clear()


# ------------------------------------------------------------------------------------ schema
def test_shipped_tables_follow_the_schema():
    names = [n for n in os.listdir(cost.TABLES_DIR) if n.endswith(".json")] if os.path.isdir(cost.TABLES_DIR) else []
    for name in names:
        t = cost.load_table(os.path.join(cost.TABLES_DIR, name))
        assert t["kind"] in cost.KINDS and t["entries"], name


@pytest.mark.parametrize("broken, says", [
    ({"kind": "tpu"}, "kind must be one of"),
    ({"date": None}, "needs 'date'"),
    ({"cpu_flags": "avx2"}, "needs 'cpu_flags'"),
    ({"entries": [entry("fused_elemwise", {}, -1.0, 1.0)]}, "fused_ms = -1.0"),
    ({"entries": [dict(entry("fused_elemwise", {}, 1.0, 1.0), case=[1])]}, "entry 0 needs 'case'"),
    ({"entries": [dict(entry("fused_elemwise", {}, 1.0, 1.0), unfused_ms=True)]}, "needs 'unfused_ms'"),
])
def test_a_broken_table_is_refused_with_what_is_wrong(broken, says):
    t = dict(table([entry("fused_elemwise", {}, 1.0, 2.0)]), **broken)
    with pytest.raises(cost.CostTableError, match=says):
        cost.validate(t, "x.json")


def test_a_gpu_table_loads_with_the_same_schema_and_decides(tables_dir):
    write(tables_dir, table([entry("fused_attention", {"heads": 12, "seq": 128, "head_dim": 64}, 0.5, 1.0,
                                   dtype="float16")], kind="gpu", device="NVIDIA H200"))
    t = cost.table_for("gpu", "NVIDIA H200")
    assert t is not None and t["kind"] == "gpu" and "cpu_flags" not in t
    d = cost.decide("fused_attention", "float16", "forward", {"heads": 12, "seq": 256, "head_dim": 64},
                    kind="gpu", device="NVIDIA H200")
    assert d.fuse and "NVIDIA H200" in d.reason and "nearest measured" in d.reason
    # another GPU has no table: the GPU fallback fuses, and says there is no table
    d = cost.decide("fused_attention", "float16", "forward", {}, kind="gpu", device="NVIDIA A100")
    assert d.fuse and "no cost table" in d.reason


# ------------------------------------------------------------------------------------ decisions
CASE = {"ops": "BatchNorm+relu", "adds_reorders": True}


def test_decision_follows_the_nearest_measured_case():
    t = table([entry("fused_elemwise", dict(CASE, elements=1000), 1.0, 2.0),        # small maps: a win
               entry("fused_elemwise", dict(CASE, elements=1000000), 2.0, 1.5)])    # large maps: slower
    small = cost.decide("fused_elemwise", "float32", "forward", dict(CASE, elements=3000), table=t)
    large = cost.decide("fused_elemwise", "float32", "forward", dict(CASE, elements=400000), table=t)
    assert small.fuse and "1.000 ms vs 2.000 ms" in small.reason
    assert not large.fuse and large.reason.startswith("slower or no faster") and "2.000 ms vs 1.500 ms" in large.reason


def test_a_tie_within_the_margin_is_declined():
    t = table([entry("fused_elemwise", CASE, 0.99, 1.0)])
    assert not cost.decide("fused_elemwise", "float32", "forward", CASE, table=t).fuse


def test_other_categorical_features_dtype_or_pass_fall_back():
    t = table([entry("fused_elemwise", CASE, 1.0, 2.0)])
    for op, dtype, pass_, case in (("fused_elemwise", "float32", "forward", dict(CASE, ops="BatchNorm+sigmoid")),
                                   ("fused_elemwise", "bfloat16", "forward", CASE),
                                   ("fused_elemwise", "float32", "backward", CASE),
                                   ("fused_se", "float32", "forward", CASE)):
        d = cost.decide(op, dtype, pass_, case, table=t)
        assert not d.fuse and "no cost table measured on this CPU" in d.reason, (op, dtype, pass_, case)


def test_cpu_fallback_declines_only_what_adds_reorders_or_breaks_onednn_fusion():
    assert not cost.fallback("fused_elemwise", CASE, "cpu").fuse
    d = cost.fallback("conv_bn", {"breaks_onednn_fusion": True}, "cpu")
    assert not d.fuse and "fuses at bind" in d.reason
    assert cost.fallback("fused_elemwise", dict(CASE, adds_reorders=False), "cpu").fuse


def test_a_table_of_another_cpu_or_other_flags_is_not_taken(tables_dir):
    here, flags = cost.cpu_identity()
    write(tables_dir, table([entry("fused_elemwise", CASE, 1.0, 2.0)], device="Some Other CPU"), "a.json")
    write(tables_dir, table([entry("fused_elemwise", CASE, 1.0, 2.0)], flags=list(flags) + ["amx_bf16"]
                            if "amx_bf16" not in flags else []), "b.json")
    assert cost.table_for("cpu") is None
    write(tables_dir, table([entry("fused_elemwise", CASE, 1.0, 2.0)]), "c.json")
    assert cost.table_for("cpu")["device"] == here


def test_decisions_off(monkeypatch):
    monkeypatch.setenv("MXFUSION_NO_COST", "1")
    assert cost.decide("fused_elemwise", "float32", "forward", CASE).fuse


# ------------------------------------------------------------------------------------ the elementwise rule
def preactivation():
    """ResNet v2's pre-activation: (conv + x) → BatchNorm → relu → conv (the sum in oneDNN's layout)."""
    x = S.var("data")
    y = S.Convolution(x, num_filter=8, kernel=(1, 1), no_bias=True, name="c1") + x
    y = S.Activation(S.BatchNorm(y, fix_gamma=False, name="bn"), act_type="relu", name="act")
    return S.Convolution(y, num_filter=8, kernel=(1, 1), no_bias=True, name="c2")


SHAPES = {"data": (1, 8, 6, 6)}
ELEMENTS = 8 * 6 * 6


@pytest.mark.usefixtures("no_regions")
def test_preactivation_between_convolutions_declined_where_measured_slower(tables_dir):
    write(tables_dir, table([entry("fused_elemwise", dict(CASE, elements=ELEMENTS), 1.2, 1.0)]))
    res = fuse_and_check(preactivation(), SHAPES)
    assert "fused_elemwise" not in ops(res) and ops(res)["BatchNorm"] == 1
    reason = res.report.rules["elementwise"].rejected
    text = res.report.to_text()
    assert "stays MXNet's" in text and "1.200 ms vs 1.000 ms" in text and "blocked layout" in text, (reason, text)


@pytest.mark.usefixtures("no_regions")
def test_preactivation_fused_where_measured_faster(tables_dir):
    write(tables_dir, table([entry("fused_elemwise", dict(CASE, elements=ELEMENTS), 0.5, 1.0)]))
    res = fuse_and_check(preactivation(), SHAPES, rtol=1e-5)
    assert ops(res).get("fused_elemwise") == 1 and "BatchNorm" not in ops(res)


@pytest.mark.usefixtures("no_regions")
def test_preactivation_without_a_table_declined_by_the_conservative_rule(tables_dir):
    res = fuse_and_check(preactivation(), SHAPES)
    assert "fused_elemwise" not in ops(res)
    assert "no cost table measured on this CPU" in res.report.to_text()


def test_batchnorm_relu_not_after_a_convolution_fuses_whatever_the_table(tables_dir):
    # the input is NCHW (no convolution wrote it): MXNet reorders as much either way
    write(tables_dir, table([entry("fused_elemwise", dict(CASE, elements=ELEMENTS), 9.0, 1.0)]))
    x = S.var("data")
    y = S.Activation(S.BatchNorm(S.Pooling(x, kernel=(1, 1), pool_type="max"), fix_gamma=False, name="bn"),
                     act_type="relu")
    res = fuse_and_check(y, SHAPES, rtol=1e-5)
    assert ops(res).get("fused_elemwise") == 1


def test_gpu_fusion_is_not_decided_by_the_cpu_table(tables_dir):
    write(tables_dir, table([entry("fused_elemwise", dict(CASE, elements=ELEMENTS), 9.0, 1.0)]))
    sym = preactivation()
    arg, aux = random_params(sym, SHAPES)
    res = fusion.fuse(sym, arg, aux, input_shapes=SHAPES, device="gpu", self_check=False)
    assert ops(res).get("fused_elemwise") == 1
