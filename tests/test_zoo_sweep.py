"""benchmarks/zoo_sweep.py: a model per process, one JSON line each, resumable, and the summary table.

The machinery runs on the project's own copies (``--source builtin``: no GluonCV needed); the GluonCV
test runs where ``gluoncv`` is installed.  Small models, no self-check, one short timing round: the
figures are not the point here, the records are.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "zoo_sweep.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import zoo_sweep  # noqa: E402

QUICK = ["--small", "--no-self-check", "--repeats", "1", "--rounds", "1"]


def sweep(*argv, timeout=300):
    # the suite's own environment: a MXFUSION_NO_CUDA of its own would read the library this checkout
    # built (with its "gpu" registrations where nvcc is installed) as stale, and under MXFUSION_AUTOBUILD
    # rebuild it without them — stale again for every later test and for the developer's shell
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=dict(os.environ))
    return proc.returncode, proc.stdout, proc.stderr


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_record(r):
    assert r["status"] == "ok", r.get("error")
    assert r["stage"] == "done" and set(r["seconds"]) >= {"build", "fuse", "fuse_no_shapes", "verify",
                                                           "verify_no_shapes"}
    for which in ("with_shapes", "no_shapes"):
        w = r[which]
        assert w["verify"]["ok"] and w["verify"]["status"] in ("OK", "WEAK"), w["verify"]
        assert w["first_line"].startswith("mxnet-fusion report") and w["ops"][0] >= w["ops"][1]
        assert w["fused"] == w["fused_beyond_bind"] + sum(w["same_as_bind"].values())
    fams = r["rule_families"]
    assert fams and all(set(f) >= {"fused", "rejected", "near_misses", "near_miss_reasons"} for f in fams.values())
    assert sum(f["fused"] for f in fams.values()) == r["with_shapes"]["fused"]
    if r["with_shapes"]["fused"]:
        b = r["benchmark"]
        assert b["speedup"] > 0 and len(b["rounds"]) == 1 and b["original_ms"] > 0
    else:
        assert r["benchmark"] is None and r["not_timed"]
    assert r["cpu"] and r["load_before"]


def test_builtin_sweep_records_resumes_and_records_a_timeout(tmp_path):
    out = str(tmp_path / "sweep.jsonl")
    names = ["mobilenet0.25", "resnet18_v1", "mobilenetv2_0.25"]
    code, stdout, stderr = sweep("--source", "builtin", "--only", ",".join(names), "--out", out, *QUICK)
    assert code == 0, stdout + stderr
    got = records(out)
    assert [r["model"] for r in got] == names and {r["source"] for r in got} == {"builtin"}
    for r in got:
        check_record(r)
        assert r["input_shapes"] == {"data": [1, 3, 64, 64]}
    table = stdout[stdout.index("| family |"):]
    assert "| classification | 3 | 0 |" in table and "| all | 3 | 0 |" in table, stdout

    # resumable: the models already in the file are skipped; a model past its timeout is a failure
    code, stdout, _ = sweep("--source", "builtin", "--only", ",".join(names + ["mobilenet0.5", "mobilenet0.75"]),
                            "--out", out, "--timeout", "1", "--limit", "1", *QUICK)
    assert code == 1 and "3 already in" in stdout and "1 to run" in stdout, stdout
    last = records(out)[-1]
    assert len(records(out)) == 4 and last["model"] == "mobilenet0.5" and last["status"] == "failed"
    assert last["error"] == "timeout: still running after 1 s" and last["stage"], last
    assert os.path.exists(out + ".logs/builtin--mobilenet0.5.log")
    text = zoo_sweep.summary(zoo_sweep.read_records(out))         # what --summary prints
    assert "| all | 4 | 1 |" in text and "failures (1):" in text, text
    assert "mobilenet0.5 (classification, stage " in text and ": timeout: still running after 1 s" in text


def test_gluoncv_sweep_of_three_small_models(tmp_path):
    pytest.importorskip("gluoncv")
    out = str(tmp_path / "sweep.jsonl")
    names = "cifar_resnet20_v1,cifar_resnet20_v2,mobilenet0.25"
    code, stdout, stderr = sweep("--family", "classification", "--only", names, "--out", out, *QUICK)
    assert code == 0 and "3 to run" in stdout, stdout + stderr
    got = records(out)
    assert [r["model"] for r in got] == names.split(",") and {r["zoo"] for r in got} == {"gluoncv"}
    for r in got:
        check_record(r)
    assert got[0]["input_shapes"] == {"data": [1, 3, 32, 32]} and got[2]["input_shapes"] == {"data": [1, 3, 224, 224]}
    assert "| classification | 3 | 0 |" in stdout, stdout


def test_a_zoo_that_is_not_installed_is_skipped_with_one_line(monkeypatch):
    said = []
    monkeypatch.setitem(sys.modules, "gluoncv", None)      # import gluoncv raises ImportError
    monkeypatch.setitem(sys.modules, "gluonnlp", None)
    models, skipped = zoo_sweep.zoo_models(False, say=said.append)
    assert models == [] and skipped == {}
    assert said[0].startswith("gluoncv not installed: its models skipped")
    assert said[1].startswith("gluonnlp not installed: %d models skipped" % len(zoo_sweep.GLUONNLP))


def test_families_sizes_and_left_out_models_of_gluoncv_names():
    fam = zoo_sweep.gluoncv_family
    names = {"resnet50_v1b": "classification", "hrnet_w18_small_v1_c": "classification",
             "ssd_512_mobilenet1.0_voc": "detection", "psp_resnet101_ade": "segmentation",
             "mask_rcnn_resnet18_v1b_coco": "segmentation", "hrnet_w18_small_v1_s": "segmentation",
             "simple_pose_resnet18_v1b": "pose", "i3d_resnet50_v1_kinetics400": "action", "vgg16_ucf101": "action",
             "monodepth2_resnet18_kitti_stereo_640x192": "other"}
    assert {n: fam(n) for n in names} == names
    shape = zoo_sweep.gluoncv_shape
    assert shape("slowfast_4x16_resnet50_kinetics400", "action") == (1, 3, 36, 224, 224)
    assert shape("yolo3_darknet53_coco", "detection") == (1, 3, 416, 416)
    assert shape("yolo3_darknet53_coco", "detection", small=True) == (1, 3, 320, 320)
    assert shape("resnest269", "classification") == (1, 3, 416, 416)
    assert shape("resnest269", "classification", small=True) == (1, 3, 224, 224)
    assert shape("fcn_resnet50_voc", "segmentation") is None            # read from the built network
    assert zoo_sweep.left_out("resnet50_v1_int8") and zoo_sweep.left_out("ssd_512_resnet50_v1_custom")
    assert zoo_sweep.left_out("resnet50_v1") is None


def _record(name, family, status="ok", fused=3, beyond=1, ok=True, speedup=None, error=None):
    r = {"model": name, "source": "zoo", "family": family, "status": status, "cpu": "Some CPU"}
    if status != "ok":
        r["error"], r["stage"] = error, "fuse"
        return r
    v = {"ok": ok, "status": "OK" if ok else "MISMATCH", "failure": None if ok else "fused outputs differ"}
    r["with_shapes"] = {"fused": fused, "fused_beyond_bind": beyond, "verify": v}
    r["no_shapes"] = {"fused": fused, "fused_beyond_bind": beyond, "verify": v}
    r["benchmark"] = None if speedup is None else {"speedup": speedup, "rounds": [speedup], "original_ms": 10.0,
                                                   "fused_ms": 10.0 / speedup, "warnings": []}
    return r


def test_summary_counts_speedups_failures_and_mismatches():
    rs = [_record("a", "classification", speedup=1.2), _record("b", "classification", speedup=1.02),
          _record("c", "classification", speedup=0.9), _record("d", "classification", fused=0, beyond=0),
          _record("e", "detection", fused=2, beyond=0, ok=False),
          _record("f", "detection", status="failed", error="timeout: still running after 5 s"),
          _record("a", "classification", speedup=1.3)]           # run again: the last record counts
    text = zoo_sweep.summary(rs, {"x_int8": "quantized", "y_int8": "quantized"})
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()
            if ln.startswith("| ") and "family" not in ln}
    assert rows["classification"] == ["classification", "4", "0", "75 %", "75 %", "100 %", "3", "2", "1", "1", "1.02x"]
    assert rows["detection"] == ["detection", "2", "1", "100 %", "0 %", "0 %", "0", "0", "0", "0", "-"]
    assert rows["all"][:3] == ["all", "6", "1"]
    assert "left out: 2 quantized" in text and "CPU: Some CPU" in text
    assert "  f (detection, stage fuse): timeout: still running after 5 s" in text
    assert "  e (with shapes): fused outputs differ" in text
    assert "  c: 0.90x (rounds 0.90; 10.0 -> 11.1 ms)" in text
