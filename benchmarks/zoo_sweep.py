"""Model-zoo sweep: every GluonCV (and GluonNLP) model fused, verified and timed against MXNet's default bind.

    pip install gluoncv==0.10.5.post0 gluonnlp==0.10.0     # not dependencies of the project
    python benchmarks/zoo_sweep.py [--out zoo-sweep.jsonl] [--family classification,detection]
                                   [--only NAME,NAME] [--limit N] [--small] [--timeout 1200]
                                   [--repeats 10] [--rounds 3] [--no-self-check] [--retry-failed]
    python benchmarks/zoo_sweep.py --summary [--out zoo-sweep.jsonl]   # the table of what is there
    python benchmarks/zoo_sweep.py --list [--source builtin]           # the models, their families and sizes

Models (``--source``): ``zoo`` (the default) is every constructor of GluonCV 0.10's model zoo
(classification, detection, segmentation, pose, action recognition, other) and GluonNLP 0.10's
(family ``nlp``) that builds offline -- ``pretrained=False``, ``pretrained_base=False``, random
weights (``fusion.testing.gcv_zoo.gcv_zoo_model``: Xavier, BatchNorm statistics randomized, biases
N(0, 0.2)) -- at batch 1 and the input size GluonCV uses for it (``--small``: a smaller one where
the model takes any: classifiers with global pooling at 224, YOLOv3 at 320).  Left out, and counted
in the summary: the ``*_int8`` models (quantized: they need their calibrated pretrained params) and
the ``*custom*`` ones (they need a class list or a pretrained net to transfer from).  A zoo that is
not importable is skipped with one line ("gluonnlp not installed: 12 models skipped") and the sweep
goes on.  ``builtin`` sweeps the project's own copies instead, without GluonCV: the GluonCV-style
networks of ``fusion/testing/gluoncv.py`` and ``mxnet.gluon.model_zoo.vision``'s (``--small``: 64×64
where the network takes it) -- what the tests run.

Per model, in a process of its own (a model that crashes or runs past ``--timeout`` seconds is
recorded as a failure with its cause and the stage it was in, and the sweep goes on):

1. build and export (stage ``build``);
2. ``fusion.fuse`` with the input shapes (the per-rewrite self-check on unless ``--no-self-check``,
   as ``mxfuse``) and without them (``fuse``, ``fuse_no_shapes``);
3. ``fusion.verify`` of both against the original (``verify``, ``verify_no_shapes``; tolerance
   ``mxfuse --verify``'s);
4. the fused model (with input shapes) timed against the original under MXNet's default bind with
   ``fusion.check.bench.benchmark`` -- what ``mxfuse --benchmark`` runs: interleaved calls,
   medians -- ``--rounds`` times, each round bound afresh (``benchmark``); the speed-up is the
   median of the rounds'.  Not timed: a model whose verification failed, or where nothing was
   rewritten (the same graph).

Each model is one JSON line in ``--out``: its status, the stage that failed and why, seconds per
stage, op counts, rewrites made (and how many only do what MXNet's bind does itself: BatchNorm
folded into convolutions, no-ops removed), per rule family the candidates fused, rejected (with
their reasons) and the near-misses (grouped by their first reason), the verification and the
timing figures, the CPU and the load average.  The sweep is resumable -- a model already in the
file is skipped (``--retry-failed`` runs the failures again) -- and several sweeps may share one
file: a model is claimed with a lock (``OUT.claims/``) while it runs and its line is appended
under a lock on the file (but sweeps running at once slow each other's timings down).  The output
of a failed model is kept in ``OUT.logs/``.  At the end, and with ``--summary``, a table per family:
models, failures, models with rewrites, verify OK, and the speed-up distribution (≥ 1.0×, ≥ 1.1×,
< 0.97×), then the failures with their causes, the verification failures and the slowdowns.

The machines are shared: wrap a timing run in ``flock /tmp/mxf-bench.lock``.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)

FAMILIES = ("classification", "detection", "segmentation", "pose", "action", "other", "nlp")
SOURCES = ("zoo", "builtin")
SPEEDUP_BUCKETS = ((">= 1.1x", lambda s: s >= 1.1), (">= 1.0x", lambda s: s >= 1.0), ("< 0.97x", lambda s: s < 0.97))
NEAR_MISS_KINDS = 5         # per rule family and model: the most frequent kinds of near-miss kept
REASON_CHARS = 300


# ------------------------------------------------------------------------------------------ the models

@dataclass
class Model:
    name: str
    source: str                     # "zoo" (GluonCV / GluonNLP) or "builtin"
    family: str
    zoo: str = "gluoncv"            # gluoncv, gluonnlp, fusion.testing, mxnet.vision
    shape: Optional[Tuple[int, ...]] = None         # the image/video input; None: found when built
    note: str = ""

    @property
    def key(self) -> Tuple[str, str]:
        return self.source, self.name


#: GluonNLP 0.10's model zoo (``gluonnlp.model.get_model``): name -> how it is called.  BERT-style
#: encoders at sequence length 128, language models 35 steps (their usual BPTT length), ELMo 35
#: words of 50 characters; the Transformer's encoder and its decoder, each as a model of its own (the
#: whole NMTModel is not a HybridBlock): the decoder over 128 target positions reading an encoder
#: memory of 128 (its memory mask an input, as ``init_state_from_encoder`` gives it).
GLUONNLP = {
    "bert_12_768_12": "bert", "bert_24_1024_16": "bert", "ernie_12_768_12": "bert",
    "roberta_12_768_12": "roberta", "roberta_24_1024_16": "roberta", "distilbert_6_768_12": "roberta",
    "standard_lstm_lm_200": "lm", "standard_lstm_lm_650": "lm", "standard_lstm_lm_1500": "lm",
    "awd_lstm_lm_1150": "lm", "awd_lstm_lm_600": "lm", "big_rnn_lm_2048_512": "lm",
    "elmo_2x1024_128_2048cnn_1xhighway": "elmo", "elmo_2x2048_256_2048cnn_1xhighway": "elmo",
    "elmo_2x4096_512_2048cnn_2xhighway": "elmo", "transformer_en_de_512": "transformer",
    "transformer_en_de_512_decoder": "transformer_decoder",
}
SEQ, LM_STEPS, ELMO_CHARS, VOCAB = 128, 35, 50, 1000

_ACTION = re.compile(r"(kinetics|ucf101|hmdb51|sthsthv2)|^(c3d|p3d|r2plus1d|i3d|slowfast)_")
_DETECTION = re.compile(r"^(ssd|yolo3|faster_rcnn|doublehead_rcnn|center_net)_")
_SEGMENTATION = re.compile(r"^(fcn|psp|deeplab|icnet|fastscnn|danet|mask_rcnn)_|^hrnet_.*_s$")
_POSE = re.compile(r"^(simple_pose|mobile_pose|alpha_pose)_")
_OTHER = re.compile(r"^(siamrpn|monodepth2)_")


def gluoncv_family(name: str) -> str:
    for family, pattern in (("action", _ACTION), ("detection", _DETECTION), ("segmentation", _SEGMENTATION),
                            ("pose", _POSE), ("other", _OTHER)):
        if pattern.search(name):
            return family
    return "classification"


def left_out(name: str) -> Optional[str]:
    """Why a GluonCV model cannot be swept offline with random weights, or None."""
    if name.endswith("_int8"):
        return "quantized (int8): needs its calibrated pretrained params"
    if "custom" in name:
        return "needs a class list or a pretrained net to transfer from (*custom*)"
    return None


def _video_shape(name: str) -> Tuple[int, ...]:
    frames = {"slowfast_4x16": 36, "slowfast_8x8": 40, "slowfast_16x8": 80, "i3d_slow": 16, "c3d": 16,
              "r2plus1d": 16, "p3d": 16, "i3d": 32}
    for prefix, t in frames.items():
        if name.startswith(prefix):
            side = 112 if prefix in ("c3d", "r2plus1d") else 224
            return (1, 3, t, side, side)
    return (1, 3, 299, 299) if name.startswith("inceptionv3") else (1, 3, 224, 224)     # TSN-style 2-D nets


def gluoncv_shape(name: str, family: str, small: bool = False) -> Optional[Tuple[int, ...]]:
    """The input shape GluonCV uses for model ``name`` (None: read from the built network, a
    segmentation model's crop size)."""
    if family == "action":
        return _video_shape(name)
    if family == "segmentation":
        return (1, 3, 600, 800) if name.startswith("mask_rcnn") else None
    if family == "detection":
        if name.startswith("ssd_300"):
            return (1, 3, 300, 300)
        if name.startswith("ssd_512") or name.startswith("center_net"):
            return (1, 3, 512, 512)
        if name.startswith("yolo3"):
            return (1, 3, 320, 320) if small else (1, 3, 416, 416)
        return (1, 3, 600, 800)                     # the R-CNNs: short side 600
    if family == "pose":
        return (1, 3, 320, 256) if name.startswith("alpha_pose") else (1, 3, 256, 192)
    if family == "other":
        if name.startswith("monodepth2"):
            return (1, 6 if "posenet" in name else 3, 192, 640)
        return (1, 3, 127, 127)                     # siamrpn's template (and its 255² search image: build())
    if name.startswith("cifar_"):
        return (1, 3, 32, 32)
    if name.startswith(("inceptionv3", "xception")):
        return (1, 3, 299, 299)
    if name == "nasnet_6_4032":
        return (1, 3, 331, 331)
    usual = {"resnest101": 256, "resnest200": 320, "resnest269": 416}.get(name)
    side = 224 if small or usual is None else usual
    return (1, 3, side, side)


def _importable(module: str) -> Optional[str]:
    """None when ``module`` imports, else why not (one line)."""
    try:
        __import__(module)
    except Exception as e:      # ImportError, and a package broken by an incompatible numpy
        return "%s: %s" % (type(e).__name__, (str(e).splitlines() or [""])[0])
    return None


def zoo_models(small: bool, say=print) -> Tuple[List[Model], Dict[str, str]]:
    """GluonCV's and GluonNLP's models, and those left out with why."""
    models: List[Model] = []
    skipped: Dict[str, str] = {}
    why = _importable("gluoncv")
    if why:
        say("gluoncv not installed: its models skipped (%s)" % why)
    else:
        from gluoncv.model_zoo import get_model_list
        for name in get_model_list():
            reason = left_out(name)
            if reason:
                skipped[name] = reason
                continue
            family = gluoncv_family(name)
            models.append(Model(name, "zoo", family, "gluoncv", gluoncv_shape(name, family, small)))
    why = _importable("gluonnlp")
    if why:
        say("gluonnlp not installed: %d models skipped (%s)" % (len(GLUONNLP), why))
    else:
        models += [Model(n, "zoo", "nlp", "gluonnlp", None, kind) for n, kind in GLUONNLP.items()]
    return models, skipped


#: mxnet.gluon.model_zoo.vision's networks (``vision.get_model`` keeps its table to itself)
VISION = ("resnet18_v1", "resnet34_v1", "resnet50_v1", "resnet101_v1", "resnet152_v1", "resnet18_v2", "resnet34_v2",
          "resnet50_v2", "resnet101_v2", "resnet152_v2", "vgg11", "vgg13", "vgg16", "vgg19", "vgg11_bn", "vgg13_bn",
          "vgg16_bn", "vgg19_bn", "alexnet", "densenet121", "densenet161", "densenet169", "densenet201",
          "squeezenet1.0", "squeezenet1.1", "inceptionv3", "mobilenet1.0", "mobilenet0.75", "mobilenet0.5",
          "mobilenet0.25", "mobilenetv2_1.0", "mobilenetv2_0.75", "mobilenetv2_0.5", "mobilenetv2_0.25")
#: those that end in global pooling take a small input
_ANY_SIZE = re.compile(r"^(resnet|mobilenet)")


def builtin_models(small: bool) -> List[Model]:
    """The project's own copies: fusion/testing/gluoncv.py's networks and mxnet.gluon.model_zoo.vision's."""
    from fusion.testing.gluoncv import MODELS as GCV

    side = 64 if small else 224
    out = [Model(n, "builtin", "classification", "fusion.testing", (1, 3, side, side)) for n in GCV]
    for n in VISION:
        shape = (1, 3, 299, 299) if n.startswith("inception") else (1, 3, side, side) if _ANY_SIZE.match(n) \
            else (1, 3, 224, 224)
        out.append(Model(n, "builtin", "classification", "mxnet.vision", shape))
    return out


def find_model(source: str, name: str, small: bool) -> Model:
    """The model ``name`` of ``source`` (in a worker: without importing the zoos to list them)."""
    if source == "builtin":
        return {m.name: m for m in builtin_models(small)}[name]
    if name in GLUONNLP:
        return Model(name, "zoo", "nlp", "gluonnlp", None, GLUONNLP[name])
    family = gluoncv_family(name)
    return Model(name, "zoo", family, "gluoncv", gluoncv_shape(name, family, small))


def catalogue(source: str, small: bool, say=print) -> Tuple[List[Model], Dict[str, str]]:
    if source == "builtin":
        return builtin_models(small), {}
    return zoo_models(small, say)


# ------------------------------------------------------------------------------------------ building one

def _nlp_vocab(nlp, bert_style: bool):
    import collections

    words = collections.Counter("w%d" % i for i in range(VOCAB))      # made up: nothing is downloaded
    return nlp.vocab.BERTVocab(words) if bert_style else nlp.Vocab(words)


def build_gluonnlp(model: Model, seed: int = 0):
    """(symbol, arg, aux, input shapes) of a GluonNLP model with random weights and a made-up vocabulary."""
    import gluonnlp as nlp
    import mxnet as mx
    import numpy as np

    from fusion.testing import gluon_export

    kind = model.note
    mx.random.seed(seed)
    with mx.name.NameManager():
        if kind == "bert":
            net, _ = nlp.model.get_model(model.name, dataset_name=None, vocab=_nlp_vocab(nlp, True), pretrained=False,
                                         use_pooler=True, use_decoder=False, use_classifier=False)
            args = [mx.nd.zeros((1, SEQ)), mx.nd.zeros((1, SEQ)), mx.nd.array([SEQ])]
        elif kind == "roberta":
            extra = {"use_decoder": False} if model.name.startswith("roberta") else {}
            net, _ = nlp.model.get_model(model.name, dataset_name=None, vocab=_nlp_vocab(nlp, True), pretrained=False,
                                         **extra)
            args = [mx.nd.zeros((1, SEQ)), mx.nd.array([SEQ])]
        elif kind == "lm":
            # dropout 0: GluonNLP 0.10's StandardRNN calls mx.nd.Dropout inside hybrid_forward (no symbol can
            # be traced with it); an inference graph has no dropout to run anyway
            extra = {"dropout": 0} if model.name.startswith("standard_") else {}
            net, _ = nlp.model.get_model(model.name, dataset_name=None, vocab=_nlp_vocab(nlp, False), pretrained=False,
                                         **extra)
            args = [mx.nd.zeros((LM_STEPS, 1)), net.begin_state(batch_size=1, func=mx.nd.zeros)]
        elif kind == "elmo":
            net = nlp.model.get_model(model.name, dataset_name=None, pretrained=False)
            net = net[0] if isinstance(net, tuple) else net
            args = [mx.nd.zeros((1, LM_STEPS, ELMO_CHARS)), net.begin_state(mx.nd.zeros, batch_size=1)]
        elif kind == "transformer":     # get_model wants a dataset's vocabulary: the encoder built as it builds it
            from gluonnlp.model.transformer import get_transformer_encoder_decoder, transformer_en_de_hparams as hp

            net = get_transformer_encoder_decoder(
                num_layers=hp["num_layers"], num_heads=hp["num_heads"], scaled=hp["scaled"], units=hp["num_units"],
                hidden_size=hp["hidden_size"], dropout=hp["dropout"], max_src_length=SEQ, max_tgt_length=SEQ)[0]
            args = [mx.nd.zeros((1, SEQ, hp["num_units"])), None, mx.nd.array([SEQ])]
        elif kind == "transformer_decoder":
            from gluonnlp.model.transformer import get_transformer_encoder_decoder, transformer_en_de_hparams as hp

            net = get_transformer_encoder_decoder(
                num_layers=hp["num_layers"], num_heads=hp["num_heads"], scaled=hp["scaled"], units=hp["num_units"],
                hidden_size=hp["hidden_size"], dropout=hp["dropout"], max_src_length=SEQ, max_tgt_length=SEQ)[1]
            mem = mx.nd.zeros((1, SEQ, hp["num_units"]))
            args = [mx.nd.zeros((1, SEQ, hp["num_units"])), net.init_state_from_encoder(mem, mx.nd.array([SEQ])),
                    mx.nd.array([SEQ])]
        else:
            raise ValueError("no builder for GluonNLP model kind %r" % kind)
    if not isinstance(net, mx.gluon.HybridBlock):
        raise TypeError("%s is a %s, not a HybridBlock: it cannot be exported as a symbol"
                        % (model.name, type(net).__name__))
    sym, arg, aux = gluon_export(net, (), seed, init=mx.init.Normal(0.02), call_with=args)
    flat: List = []

    def walk(a):
        if isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif a is not None:
            flat.append(a)

    walk(args)
    # Gluon names the inputs as it flattens them: data (one), else data0, data1, ...
    names = ["data"] if len(flat) == 1 else ["data%d" % i for i in range(len(flat))]
    inputs = set(sym.list_arguments())
    shapes = {n: tuple(a.shape) for n, a in zip(names, flat) if n in inputs}
    rng = np.random.default_rng(seed)
    for name in sorted(arg):        # GluonNLP starts them at 0 and 1: a rewrite that changed one would go unseen
        if name.endswith(("_bias", "_beta")):
            arg[name] = mx.nd.array(rng.normal(0.0, 0.1, arg[name].shape))
        elif name.endswith("_gamma"):
            arg[name] = mx.nd.array(rng.uniform(0.5, 1.5, arg[name].shape))
    return sym, arg, aux, shapes


def _segmentation_shape(name: str) -> Tuple[int, ...]:
    """A GluonCV segmentation network's input: the crop size its upsampling was built for."""
    import gluoncv

    try:
        net = gluoncv.model_zoo.get_model(name, pretrained=False, pretrained_base=False)
    except TypeError:
        net = gluoncv.model_zoo.get_model(name, pretrained=False)
    up = getattr(net, "_up_kwargs", None) or {}
    h, w = up.get("height"), up.get("width")
    crop = getattr(net, "crop_size", None) or 480
    return (1, 3, int(h or crop), int(w or crop))


def build(model: Model, seed: int = 0):
    """(symbol, arg, aux, input shapes) of ``model``, random weights."""
    if model.zoo == "gluonnlp":
        return build_gluonnlp(model, seed)
    if model.zoo == "gluoncv":
        from fusion.testing.gcv_zoo import gcv_zoo_model

        shape = model.shape or _segmentation_shape(model.name)
        if model.name.startswith("siamrpn"):        # two inputs: the template and the image searched
            shapes = [tuple(shape), (1, 3, 287, 287)]     # the size its cross-correlation's fixed 24² reshape needs
            sym, arg, aux = gcv_zoo_model(model.name, shapes, seed, bn_by_nodes=True)
            return sym, arg, aux, {"data%d" % i: s for i, s in enumerate(shapes)}
        sym, arg, aux = gcv_zoo_model(model.name, shape, seed, bn_by_nodes=True)
    elif model.zoo == "fusion.testing":
        from fusion.testing.gluoncv import gluoncv_model

        shape = model.shape
        sym, arg, aux = gluoncv_model(model.name, shape, seed)
    else:
        from fusion.testing import zoo_model

        shape = model.shape
        sym, arg, aux = zoo_model(model.name, shape, seed)
    return sym, arg, aux, {"data": tuple(shape)}


# ------------------------------------------------------------------------------------------ the worker

def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return ("%s: %s" % (type(e).__name__, text) if text else type(e).__name__)[:REASON_CHARS]


def _rule_families() -> Dict[str, str]:
    from patterns import FAMILIES as RULE_FAMILIES, rules_by_name

    known = rules_by_name()
    return {r.name: fam for fam in RULE_FAMILIES for r in known[fam]}


def family_counts(report) -> Dict[str, dict]:
    """Per rule family (a rule of no family stands for itself): candidates fused and rejected (the
    rejections' reasons grouped), near-misses grouped by their first reason."""
    from fusion.engine.report import group_reasons

    of = _rule_families()
    out: Dict[str, dict] = {}
    for r in report.rules.values():
        fam = of.get(r.name, r.name)
        f = out.setdefault(fam, {"fused": 0, "rejected": 0, "near_misses": 0, "rejected_reasons": {},
                                 "near_miss_reasons": {}})
        f["fused"] += len(r.fused)
        f["rejected"] += len(r.rejected)
        f["near_misses"] += len(r.near_misses)
        for key, source in (("rejected_reasons", r.rejected), ("near_miss_reasons", r.near_misses)):
            for reason, anchors in group_reasons(source):
                reason = reason[:REASON_CHARS]
                f[key][reason] = f[key].get(reason, 0) + len(anchors)
    for f in out.values():
        for key in ("rejected_reasons", "near_miss_reasons"):
            top = sorted(f[key].items(), key=lambda kv: -kv[1])
            f[key] = [{"reason": k, "count": n} for k, n in top[:NEAR_MISS_KINDS]]
    return {k: v for k, v in sorted(out.items()) if v["fused"] or v["rejected"] or v["near_misses"]}


def _fusion_figures(report) -> dict:
    return {"fused": report.fused_count, "fused_beyond_bind": report.beyond_bind_count,
            "same_as_bind": report.same_as_bind(), "ops": [report.ops_before, report.ops_after],
            "first_line": report.to_text().splitlines()[0],
            "more_with_input_shapes": report.extra.get("more_with_input_shapes", 0)}


def _verify_figures(v, rtol: float) -> dict:
    d = v.to_dict(rtol)
    return {"ok": d["ok"], "status": d["status"], "max_rel": d["max_rel"], "rtol": rtol, "failure": d["failure"],
            "original_spread": (d["original_spread"] or {}).get("max_rel"),
            "piecewise": bool(d["piecewise"]),
            # values judged against the original in float64 (fusion/check/cuts.py): (name, fused, original f32)
            "float64": [[e["value"], e["fused"], e["original_f32"]] if e.get("value") is not None else [None, e["why"]]
                        for e in d.get("float64") or []]}


def _load() -> str:
    return "%.1f %.1f %.1f" % os.getloadavg()


class _Record:
    """The model's JSON record, written to ``path`` after every stage (so a crash or a timeout
    leaves what was done), with the stage now running announced on stderr."""

    def __init__(self, path: str, record: dict):
        self.path, self.data = path, record
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def stage(self, name: str):
        self.data["stage"] = name
        self.save()
        sys.stderr.write("zoo_sweep: stage %s\n" % name)
        sys.stderr.flush()
        t = time.perf_counter()
        yield
        self.data["seconds"][name] = round(time.perf_counter() - t, 2)
        self.save()


def run_one(model: Model, out_path: str, self_check: bool, repeats: int, rounds: int) -> dict:
    """Build, fuse, verify and time ``model`` (in a worker process), writing its record to ``out_path``."""
    import mxnet as mx

    import fusion
    from bench_cv import cpu_model
    from fusion.check.bench import benchmark
    from fusion.check.verify import random_inputs
    from fusion.precision.policy import tolerance

    rec = _Record(out_path, {"model": model.name, "source": model.source, "family": model.family,
                             "zoo": model.zoo, "status": "running", "stage": "start", "seconds": {},
                             "cpu": cpu_model(), "mxnet": mx.__version__, "fusion": fusion.__version__,
                             "load_before": _load(), "self_check": self_check})
    d = rec.data
    try:
        with rec.stage("build"):
            sym, arg, aux, shapes = build(model)
        d["input_shapes"] = {k: list(v) for k, v in shapes.items()}
        with rec.stage("fuse"):
            fused = fusion.fuse(sym, arg, aux, input_shapes=shapes, self_check=self_check)
        d["with_shapes"] = _fusion_figures(fused.report)
        d["rule_families"] = family_counts(fused.report)
        d["library_ops"] = {k: v for k, v in sorted(fused.graph.count_ops().items()) if k.startswith("fused_")}
        with rec.stage("fuse_no_shapes"):
            plain = fusion.fuse(sym, arg, aux)
        d["no_shapes"] = _fusion_figures(plain.report)
        rtol = tolerance(fused.report.precision)
        with rec.stage("verify"):
            d["with_shapes"]["verify"] = _verify_figures(fusion.verify((sym, arg, aux), fused, input_shapes=shapes),
                                                         rtol)
        with rec.stage("verify_no_shapes"):
            d["no_shapes"]["verify"] = _verify_figures(fusion.verify((sym, arg, aux), plain, input_shapes=shapes),
                                                       rtol)
        d["benchmark"] = None
        if not d["with_shapes"]["verify"]["ok"]:
            d["not_timed"] = "verification failed"
        elif fused.report.fused_count == 0:
            d["not_timed"] = "nothing rewritten: the same graph"
        else:
            with rec.stage("benchmark"):
                runs = [benchmark(sym, arg, aux, fused, random_inputs(sym, arg, shapes), repeats)
                        for _ in range(rounds)]
            speedups = [r["speedup_vs_mxnet_default"] for r in runs]
            d["benchmark"] = {
                "speedup": statistics.median(speedups), "rounds": speedups,
                "speedup_vs_backend_off": statistics.median(r["speedup_vs_subgraph_off"] for r in runs),
                "original_ms": statistics.median(r["median_ms"]["original"] for r in runs),
                "fused_ms": statistics.median(r["median_ms"]["fused"] for r in runs),
                "p10_p90_ms": {k: [runs[-1]["p10_ms"][k], runs[-1]["p90_ms"][k]] for k in ("original", "fused")},
                "repeats": repeats, "warnings": sorted({w for r in runs for w in r["warnings"]})}
        d["status"] = "ok"
        d["stage"] = "done"
    except Exception as e:
        d["status"], d["error"] = "failed", _first_line(e)
        traceback.print_exc()
    d["load_after"] = _load()
    rec.save()
    return d


# ------------------------------------------------------------------------------------------ the file

@contextlib.contextmanager
def _locked(path: str, mode: str, how: int):
    with open(path, mode) as f:
        fcntl.flock(f, how)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_records(path: str) -> List[dict]:
    """The file's records (a torn last line, from a sweep killed while writing, is ignored)."""
    if not os.path.exists(path):
        return []
    out = []
    with _locked(path, "r", fcntl.LOCK_SH) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def append_record(path: str, record: dict) -> None:
    line = json.dumps(record, sort_keys=True) + "\n"
    with _locked(path, "a", fcntl.LOCK_EX) as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def claim(out: str, model: Model):
    """True while this process holds ``model`` (another sweep on the same file holds it: False)."""
    folder = out + ".claims"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "%s--%s.lock" % (model.source, re.sub(r"[^A-Za-z0-9_.-]", "_", model.name)))
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                yield False
                return
            raise
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _done(records: Iterable[dict], retry_failed: bool) -> set:
    return {(r.get("source"), r.get("model")) for r in records if r.get("status") == "ok" or not retry_failed}


# ------------------------------------------------------------------------------------------ the parent

def _last_stage(log: str) -> Optional[str]:
    stages = re.findall(r"^zoo_sweep: stage (\S+)$", log, re.M)
    return stages[-1] if stages else None


def _cause(log: str) -> str:
    """The last line that looks like an error in a worker's output."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and not ln.startswith("zoo_sweep: stage")]
    for ln in reversed(lines):
        if re.search(r"(Error|error|Check failed|Segmentation|Killed|Aborted|terminate)", ln):
            return ln[:REASON_CHARS]
    return lines[-1][:REASON_CHARS] if lines else "no output"


def _worker_env() -> Dict[str, str]:
    env = dict(os.environ)
    # nothing is downloaded: a model that would fetch weights fails at once rather than hangs
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env[k] = "http://127.0.0.1:9"
    env.pop("no_proxy", None)
    env.pop("NO_PROXY", None)
    # the op library as this checkout built it (MXFUSION_NO_CUDA only where the caller set it: a
    # library built with the CUDA toolkit reads as stale under it, and every model failed to start)
    return env


def sweep_one(model: Model, args) -> dict:
    """Run ``model`` in a worker process; its record (a failure with its cause if the worker crashed
    or ran past the timeout)."""
    with tempfile.TemporaryDirectory(prefix="zoo-sweep-") as tmp:
        out_path, log_path = os.path.join(tmp, "record.json"), os.path.join(tmp, "log.txt")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", model.name, "--source", model.source,
               "--worker-out", out_path, "--repeats", str(args.repeats), "--rounds", str(args.rounds)]
        cmd += (["--small"] if args.small else []) + ([] if args.self_check else ["--no-self-check"])
        t = time.perf_counter()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(),
                                    start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)        # the worker's own process group (start_new_session)
                proc.wait()
            except BaseException:       # Ctrl-C, SIGTERM: the worker, in a session of its own, goes too
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        seconds = time.perf_counter() - t
        with open(log_path, "rb") as f:
            log_text = f.read().decode("utf-8", "replace")
        try:
            with open(out_path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = {"model": model.name, "source": model.source, "family": model.family, "zoo": model.zoo,
                      "seconds": {}, "stage": _last_stage(log_text) or "start"}
        if timed_out:
            record["status"] = "failed"
            record["error"] = "timeout: still running after %d s" % args.timeout
        elif proc.returncode != 0 or record.get("status") == "running":
            record["status"] = "failed"
            how = ("killed by %s" % signal.Signals(-proc.returncode).name if proc.returncode < 0
                   else "exit status %d" % proc.returncode)
            record.setdefault("error", "the worker process died (%s) in stage %s: %s"
                              % (how, record.get("stage"), _cause(log_text)))
        record["wall_s"] = round(seconds, 1)
        record["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
        if record.get("status") != "ok":
            folder = args.out + ".logs"
            os.makedirs(folder, exist_ok=True)
            name = "%s--%s.log" % (model.source, re.sub(r"[^A-Za-z0-9_.-]", "_", model.name))
            with open(os.path.join(folder, name), "w") as f:
                f.write(log_text)
        return record


def describe(record: dict) -> str:
    """One progress line."""
    if record.get("status") != "ok":
        return "FAILED in stage %s (%s)" % (record.get("stage"), record.get("error"))
    w = record["with_shapes"]
    b = record.get("benchmark")
    return "%d rewrite(s), %d beyond MXNet's bind; ops %d -> %d; verify %s; %s" % (
        w["fused"], w["fused_beyond_bind"], w["ops"][0], w["ops"][1], w["verify"]["status"],
        "%.2fx vs MXNet's default bind" % b["speedup"] if b else "not timed (%s)" % record.get("not_timed"))


def select(models: List[Model], families: Optional[Sequence[str]], only: Optional[Sequence[str]]) -> List[Model]:
    if families:
        models = [m for m in models if m.family in families]
    if only:
        by_name = {m.name: m for m in models}
        models = [by_name[n] for n in only if n in by_name]
    return models


# ------------------------------------------------------------------------------------------ the summary

def _pct(n: int, of: int) -> str:
    return "%d %%" % round(100.0 * n / of) if of else "-"


def _family_table(records: Sequence[dict], width: int = 90) -> List[str]:
    """Per rule family over the models: where it fused, candidates fused and rejected, near-misses,
    and the most frequent reason of each (node names left out: ``reason_kind``)."""
    from fusion.engine.report import reason_kind

    totals: Dict[str, dict] = {}
    for r in records:
        for fam, f in (r.get("rule_families") or {}).items():
            t = totals.setdefault(fam, {"models": 0, "fused": 0, "rejected": 0, "near_misses": 0,
                                        "rejected_reasons": {}, "near_miss_reasons": {}})
            t["models"] += f["fused"] > 0
            for k in ("fused", "rejected", "near_misses"):
                t[k] += f[k]
            for k in ("rejected_reasons", "near_miss_reasons"):
                for item in f[k]:
                    kind = reason_kind(item["reason"])
                    t[k][kind] = t[k].get(kind, 0) + item["count"]
    if not totals:
        return []

    def top(reasons: Dict[str, int]) -> str:
        if not reasons:
            return "-"
        kind, n = max(reasons.items(), key=lambda kv: (kv[1], kv[0]))
        kind = kind if len(kind) <= width else kind[: width - 1] + "…"
        return "%d× %s" % (n, kind.replace("|", "\\|"))

    out = ["", "| rule family | fused in (models) | fused | rejected | near-misses | most frequent rejection "
                "| most frequent near-miss (first reason) |", "|" + "---|" * 7]
    for fam, t in sorted(totals.items(), key=lambda kv: (-kv[1]["fused"], kv[0])):
        out.append("| %s | %d | %d | %d | %d | %s | %s |" % (fam, t["models"], t["fused"], t["rejected"],
                                                            t["near_misses"], top(t["rejected_reasons"]),
                                                            top(t["near_miss_reasons"])))
    return out


def summary(records: Sequence[dict], skipped: Optional[Dict[str, str]] = None) -> str:
    """The sweep as text: a table per family, then the failures with their causes."""
    latest: Dict[Tuple[str, str], dict] = {}
    for r in records:       # a model run again (--retry-failed): its last record counts
        latest[(r.get("source"), r.get("model"))] = r
    records = list(latest.values())
    families = [f for f in FAMILIES if any(r.get("family") == f for r in records)]
    head = ("family", "models", "failed", "rewrites", "beyond bind", "verify OK", "timed", ">= 1.0x", ">= 1.1x",
            "< 0.97x", "median")
    rows = []
    for fam in families + ["all"]:
        rs = [r for r in records if fam == "all" or r.get("family") == fam]
        ok = [r for r in rs if r.get("status") == "ok"]
        fused = [r for r in rs if "with_shapes" in r]
        verified = [r for r in rs if "verify" in r.get("with_shapes", {})]
        speed = [r["benchmark"]["speedup"] for r in rs if r.get("benchmark")]
        rows.append((fam, str(len(rs)), str(len(rs) - len(ok)),
                     _pct(sum(r["with_shapes"]["fused"] > 0 for r in fused), len(fused)),
                     _pct(sum(r["with_shapes"]["fused_beyond_bind"] > 0 for r in fused), len(fused)),
                     _pct(sum(r["with_shapes"]["verify"]["ok"] for r in verified), len(verified)),
                     str(len(speed)), *(str(sum(test(s) for s in speed)) for _, test in (SPEEDUP_BUCKETS[1],
                                                                                          SPEEDUP_BUCKETS[0],
                                                                                          SPEEDUP_BUCKETS[2])),
                     "%.2fx" % statistics.median(speed) if speed else "-"))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("")
    lines.append("rewrites: models with at least one rewrite (with input shapes); beyond bind: with one that does "
                 "more than MXNet's default bind does itself (BatchNorm folded into convolutions and no-ops removed "
                 "do not count); verify OK: of the models verified; timed: fused models verified OK and timed "
                 "(median of the rounds' medians, fused vs MXNet's default bind).")
    lines += _family_table(records)
    cpus = sorted({r["cpu"] for r in records if r.get("cpu")})
    if cpus:
        lines.append("CPU: %s" % "; ".join(cpus))
    if skipped:
        kinds: Dict[str, int] = {}
        for why in skipped.values():
            kinds[why] = kinds.get(why, 0) + 1
        lines.append("left out: %s" % "; ".join("%d %s" % (n, k) for k, n in kinds.items()))
    failed = [r for r in records if r.get("status") != "ok"]
    if failed:
        lines.append("")
        lines.append("failures (%d):" % len(failed))
        for r in sorted(failed, key=lambda r: (r.get("family", ""), r.get("model", ""))):
            lines.append("  %s (%s, stage %s): %s" % (r.get("model"), r.get("family"), r.get("stage"), r.get("error")))
    bad = [r for r in records if "verify" in r.get("with_shapes", {}) and not r["with_shapes"]["verify"]["ok"]]
    bad += [r for r in records if "verify" in r.get("no_shapes", {}) and not r["no_shapes"]["verify"]["ok"]
            and r not in bad]
    if bad:
        lines.append("")
        lines.append("verification failed (%d):" % len(bad))
        for r in bad:
            for which in ("with_shapes", "no_shapes"):
                v = r.get(which, {}).get("verify")
                if v and not v["ok"]:
                    lines.append("  %s (%s): %s" % (r["model"], which.replace("_", " "), v["failure"]))
    slow = [r for r in records if r.get("benchmark") and r["benchmark"]["speedup"] < 0.97]
    if slow:
        lines.append("")
        lines.append("slower than MXNet's default bind (< 0.97x; %d):" % len(slow))
        for r in sorted(slow, key=lambda r: r["benchmark"]["speedup"]):
            b = r["benchmark"]
            lines.append("  %s: %.2fx (rounds %s; %.1f -> %.1f ms)%s" % (
                r["model"], b["speedup"], ", ".join("%.2f" % s for s in b["rounds"]), b["original_ms"],
                b["fused_ms"], "; spreads apart" if b.get("warnings") else "; within the p10-p90 spreads"))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ command line

def _names(text: Optional[str]) -> Optional[List[str]]:
    return [t.strip() for t in text.split(",") if t.strip()] if text else None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=SOURCES, default="zoo",
                    help="zoo: GluonCV's and GluonNLP's model zoos (default); builtin: the project's own copies")
    ap.add_argument("--out", default="zoo-sweep.jsonl",
                    help="JSON-lines file, one line per model (default %(default)s)")
    ap.add_argument("--family", help="comma-separated: %s" % ", ".join(FAMILIES))
    ap.add_argument("--only", help="comma-separated model names")
    ap.add_argument("--limit", type=int, help="run at most N models (those already in --out do not count)")
    ap.add_argument("--small", action="store_true", help="smaller inputs where the model takes any")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per model (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per system and round (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="benchmark rounds, each bound afresh (default %(default)s)")
    ap.add_argument("--no-self-check", dest="self_check", action="store_false",
                    help="fuse without the per-rewrite self-check (faster)")
    ap.add_argument("--retry-failed", action="store_true", help="run the models that failed before again")
    ap.add_argument("--summary", action="store_true", help="print the summary of --out and exit")
    ap.add_argument("--list", action="store_true", help="list the models selected and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    sys.path[:0] = [_REPO, _HERE]
    families = _names(args.family)
    if families and set(families) - set(FAMILIES):
        print("zoo_sweep: unknown family %s (known: %s)" % (", ".join(sorted(set(families) - set(FAMILIES))),
                                                           ", ".join(FAMILIES)), file=sys.stderr)
        return 2
    if args.worker:
        from fusion.native.env import configure_threads     # before mxnet is imported

        configure_threads()
        model = find_model(args.source, args.worker, args.small)
        record = run_one(model, args.worker_out, args.self_check, args.repeats, args.rounds)
        return 0 if record["status"] == "ok" else 1
    if args.summary:
        print(summary(read_records(args.out)))
        return 0
    # SIGTERM unwinds like Ctrl-C: the model running is not recorded (a later run does it) and its worker ends
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    models, skipped = catalogue(args.source, args.small)
    chosen = select(models, families, _names(args.only))
    unknown = sorted(set(_names(args.only) or ()) - {m.name for m in chosen})
    if unknown:
        print("zoo_sweep: not among the models selected: %s" % ", ".join(unknown), file=sys.stderr)
    if args.list:
        for m in chosen:
            print("%-45s %-15s %s" % (m.name, m.family, "x".join(map(str, m.shape)) if m.shape else "(when built)"))
        print("%d model(s)%s" % (len(chosen), "; %d left out" % len(skipped) if skipped else ""))
        return 0
    done = _done(read_records(args.out), args.retry_failed)
    todo = [m for m in chosen if m.key not in done]
    if args.limit is not None:
        todo = todo[:max(0, args.limit)]
    print("zoo_sweep: %d model(s) selected, %d already in %s, %d to run; load average %s"
          % (len(chosen), len(chosen) - len([m for m in chosen if m.key not in done]), args.out, len(todo), _load()),
          flush=True)
    ran = []
    for k, m in enumerate(todo):
        with claim(args.out, m) as mine:
            if not mine or m.key in _done(read_records(args.out), args.retry_failed):
                print("[%d/%d] %s: another sweep has it; skipped" % (k + 1, len(todo), m.name), flush=True)
                continue
            record = sweep_one(m, args)
            append_record(args.out, record)
        ran.append(record)
        shape = record.get("input_shapes", {}).get("data", m.shape or ())
        print("[%d/%d] %s (%s %s): %s (%.0f s)" % (k + 1, len(todo), m.name, m.family, "x".join(map(str, shape)),
                                                 describe(record), record["wall_s"]), flush=True)
    wanted = {m.key for m in chosen}
    print()
    print(summary([r for r in read_records(args.out) if (r.get("source"), r.get("model")) in wanted], skipped))
    return 0 if all(r.get("status") == "ok" for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
