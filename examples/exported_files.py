"""Door 1 — exported files: ``mxfuse`` on NAME-symbol.json + NAME-0000.params.

    python examples/exported_files.py [--quick]

Equivalent to:
    mxfuse examples/models/mobilenetv2_0.25-symbol.json --params examples/models/mobilenetv2_0.25-0000.params \\
           -o OUT/ --shape data=1,3,224,224 --verify --benchmark --report OUT/report.json
"""
import json
import os
import tempfile

from _common import MODEL, repeats

from fusion.doors import cli

with tempfile.TemporaryDirectory() as out:
    code = cli.main([MODEL + "-symbol.json", "--params", MODEL + "-0000.params", "-o", out + "/",
                     "--shape", "data=1,3,224,224", "--verify", "--benchmark", "--repeats", str(repeats()),
                     "--report", os.path.join(out, "report.json")])
    assert code == 0
    report = json.load(open(os.path.join(out, "report.json")))
    print("written:", sorted(os.listdir(out)))
    print("BatchNorms folded: %d; speed-up vs MXNet default bind %.2fx"
          % (sum(r["fused"] for r in report["rules"] if r["rule"].startswith("conv_bn")),
             report["benchmark"]["speedup_vs_mxnet_default"]))
