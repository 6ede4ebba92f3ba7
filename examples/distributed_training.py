"""Distributed training of a fused model: MXNet's ``dist_sync`` kvstore, or Horovod.

    python examples/distributed_training.py                  # dist_sync on this machine: a scheduler, a server and
                                                             # 2 workers, 30 steps unfused, then 30 fused
    python examples/distributed_training.py --benchmark      # more steps, runs interleaved: median steps/s
    python examples/distributed_training.py --api module     # the same through MXNet's Module API
    horovodrun --gloo -np 2 python examples/distributed_training.py --horovod

The model is a small transformer classifier (token embedding, 2 encoder layers of self-attention and a
GELU feed-forward with residual LayerNorms, mean pooling, a linear head), built with Gluon.  Each worker
trains it on its own shard of a synthetic task twice, from the same initial weights: as written
(``hybridize()``), and fused for training (``optimize_for(x, backend="fusion", mode="training")``:
``fused_attention``, ``fused_dense`` and ``fused_add_layer_norm`` with their backward).  The same
``gluon.Trainer`` (Adam) drives both: with ``kvstore=mx.kv.create("dist_sync")`` the server sums the
workers' gradients and updates the weights; under Horovod ``hvd.DistributedTrainer`` averages them.  Nothing
about the fused model needs the distributed setup to know it: ``import fusion`` in any order with
``horovod.mxnet`` (the op library keeps its symbols to itself), the same Trainer, the same kvstore.

At the end: the per-step losses of both runs side by side (fused against unfused, relative difference:
float32 rounding, ~1e-7), and the steps per second of each.

dist_sync is launched as MXNet's own tests launch it: this script started once per role with
``DMLC_ROLE=scheduler|server|worker``, ``DMLC_PS_ROOT_URI=127.0.0.1``, ``DMLC_PS_ROOT_PORT`` (a free
port), ``DMLC_NUM_SERVER=1``, ``DMLC_NUM_WORKER=2``; scheduler and server processes serve from
``import mxnet`` and exit with the workers.
"""
import argparse
import gc
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLE = os.environ.get("DMLC_ROLE")
if ROLE in ("worker", None):
    os.environ.setdefault("OMP_NUM_THREADS", "1")       # a core each: the workers share the machine
    os.environ.setdefault("MXNET_CPU_PARALLEL_SIZE", "2000000000")
sys.path.insert(0, ROOT)

import mxnet as mx  # noqa: E402  (a scheduler or server process serves here, then exits)
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

VOCAB, SEQ, UNITS, HEADS, FFN, LAYERS, CLASSES = 500, 32, 128, 4, 512, 2, 4


class EncoderLayer(gluon.HybridBlock):
    """Self-attention (query/key/value projections, heads split with reshape/transpose, batch_dot,
    softmax, batch_dot) and a GELU feed-forward, each with a residual LayerNorm: BERT's layer."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.query, self.key, self.value, self.proj = (
                gluon.nn.Dense(UNITS, flatten=False, in_units=UNITS, prefix=n + "_")
                for n in ("query", "key", "value", "proj"))
            self.ffn1 = gluon.nn.Dense(FFN, flatten=False, in_units=UNITS, prefix="ffn1_")
            self.ffn2 = gluon.nn.Dense(UNITS, flatten=False, in_units=FFN, prefix="ffn2_")
            self.ln1 = gluon.nn.LayerNorm(in_channels=UNITS, prefix="ln1_")
            self.ln2 = gluon.nn.LayerNorm(in_channels=UNITS, prefix="ln2_")

    def hybrid_forward(self, F, x):
        def split(t):     # (B, S, H*D) -> (B*H, S, D)
            return F.reshape(F.transpose(F.reshape(t, shape=(0, 0, HEADS, -1)), axes=(0, 2, 1, 3)), shape=(-3, 0, 0))

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        p = F.softmax(F.batch_dot(q, k, transpose_b=True) / math.sqrt(UNITS // HEADS), axis=-1)
        c = F.batch_dot(p, v)
        c = F.reshape(F.transpose(F.reshape(c, shape=(-4, -1, HEADS, 0, 0)), axes=(0, 2, 1, 3)), shape=(0, 0, -3))
        h = self.ln1(self.proj(c) + x)
        return self.ln2(self.ffn2(F.LeakyReLU(self.ffn1(h), act_type="gelu")) + h)


class Classifier(gluon.HybridBlock):
    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.embed = gluon.nn.Embedding(VOCAB, UNITS, prefix="embed_")
            self.pos = self.params.get("position", shape=(1, SEQ, UNITS))
            self.layers = gluon.nn.HybridSequential(prefix="enc_")
            with self.layers.name_scope():
                for _ in range(LAYERS):
                    self.layers.add(EncoderLayer())
            self.head = gluon.nn.Dense(CLASSES, in_units=UNITS, prefix="head_")

    def hybrid_forward(self, F, tokens, pos):
        x = self.layers(F.broadcast_add(self.embed(tokens), pos))
        return self.head(F.mean(x, axis=1))


def make_model(seed=0):
    """The classifier with the same weights wherever it is made (drawn by NumPy, name by name)."""
    net = Classifier(prefix="clf_")
    net.initialize()
    rng = np.random.default_rng(seed)
    for name in sorted(net.collect_params()):
        p = net.collect_params()[name]
        if name.endswith("gamma"):
            value = np.ones(p.shape)
        elif name.endswith(("bias", "beta")):
            value = np.zeros(p.shape)
        else:
            value = rng.normal(0, 0.05, p.shape)
        p.set_data(mx.nd.array(value))
    return net


def batch(rank, step, size):
    """This worker's synthetic batch: half of each sequence's tokens come from its class's quarter of
    the vocabulary, the rest from anywhere (a task the model learns within a few dozen steps)."""
    rng = np.random.default_rng(1000 * rank + step)
    labels = rng.integers(0, CLASSES, size)
    tokens = rng.integers(0, VOCAB, (size, SEQ))
    span = VOCAB // CLASSES
    cued = rng.random((size, SEQ)) < 0.5
    tokens[cued] = (labels[:, None] * span + rng.integers(0, span, (size, SEQ)))[cued]
    return mx.nd.array(tokens), mx.nd.array(labels)


def train(variant, trainer_for, rank, steps, batch_size, warmup):
    """``steps`` optimizer steps of a fresh model; (loss per step, seconds per step after ``warmup``)."""
    net = make_model()
    x0, _ = batch(rank, 0, batch_size)
    if variant == "fused":
        import fusion  # noqa: F401  (registers the backend)
        net.optimize_for(x0, backend="fusion", mode="training", static_alloc=True)
        report = net.fusion_report
        assert report.fused_count > 0, report.to_text()
    else:
        net.hybridize(static_alloc=True)
    trainer = trainer_for(net)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses, times = [], []
    for step in range(steps):
        x, y = batch(rank, step, batch_size)
        start = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch_size)
        value = float(loss.mean().asscalar())            # waits for the step
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(value)
    return losses, times


def train_module(variant, kv, rank, steps, batch_size, warmup, lr):
    """The same training through MXNet's Module API: the model's symbol (fused with ``fusion.fuse(...,
    mode="training")``), ``Module.bind`` from the data's shapes, the optimizer on ``kv``."""
    net = make_model()
    sym = net(mx.sym.var("data"))
    arg = {p.name: p.data() for p in net.collect_params().values()}
    if variant == "fused":
        import fusion
        res = fusion.fuse(sym, arg, {}, mode="training", input_shapes={"data": (batch_size, SEQ)})
        assert res.report.fused_count > 0, res.report.to_text()
        sym, arg = res.symbol, res.arg_params
    mod = mx.mod.Module(mx.sym.SoftmaxOutput(sym, name="softmax"), context=mx.cpu())
    mod.bind(data_shapes=[("data", (batch_size, SEQ))], label_shapes=[("softmax_label", (batch_size,))])
    mod.init_params(arg_params=arg, aux_params={})
    mod.init_optimizer(kvstore=kv, optimizer="adam",
                       optimizer_params={"learning_rate": lr, "rescale_grad": 1.0 / batch_size})
    losses, times = [], []
    for step in range(steps):
        x, y = batch(rank, step, batch_size)
        start = time.perf_counter()
        mod.forward_backward(mx.io.DataBatch([x], [y]))
        mod.update()
        p = mod.get_outputs()[0].asnumpy()               # the softmax: waits for the step
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(-np.log(p[np.arange(batch_size), y.asnumpy().astype(int)]).mean()))
    return losses, times


# ---------------------------------------------------------------- dist_sync

def worker_main(args):
    """A dist_sync worker: train one variant, write losses and step times to --out (JSON)."""
    kv = mx.kv.create("dist_sync")
    if args.api == "module":
        losses, times = train_module(args.variant, kv, kv.rank, args.steps, args.batch_size, args.warmup, args.lr)
    else:
        losses, times = train(args.variant, lambda net: gluon.Trainer(net.collect_params(), "adam",
                                                                      {"learning_rate": args.lr}, kvstore=kv),
                              kv.rank, args.steps, args.batch_size, args.warmup)
    with open(os.path.join(args.out, "%s-%d.json" % (args.variant, kv.rank)), "w") as f:
        json.dump({"rank": kv.rank, "workers": kv.num_workers, "losses": losses, "times": times}, f)
    # the kvstore leaves the cluster while MXNet's engine still runs: left to the interpreter's exit
    # (after MXNet's own shutdown hook), its goodbye to the scheduler never completes and the
    # process hangs
    del kv
    gc.collect()


def free_port():
    """A TCP port nothing listens on now (the OS picks it); the launch retries once if it is taken meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, variant, out, workers=2, timeout=600):
    """One dist_sync cluster on loopback for ``variant``; the workers' results.  A cluster that fails
    (its port taken since free_port() chose it, say) is started once more on another port."""
    roles = ["scheduler", "server"] + ["worker"] * workers
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--out", out,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
           "--warmup", str(args.warmup), "--api", args.api]
    for attempt in range(2):
        env = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()),
                   DMLC_NUM_SERVER="1", DMLC_NUM_WORKER=str(workers), DMLC_NODE_HOST="127.0.0.1",
                   PS_VERBOSE="0")
        logs = [tempfile.TemporaryFile(mode="w+") for _ in roles]
        procs = [subprocess.Popen(cmd, env=dict(env, DMLC_ROLE=r), stdout=log, stderr=subprocess.STDOUT)
                 for r, log in zip(roles, logs)]
        deadline = time.monotonic() + timeout
        try:               # until all are done, one failed (the others would wait for it), or the time is up
            while time.monotonic() < deadline:
                codes = [p.poll() for p in procs]
                if None not in codes or any(c not in (None, 0) for c in codes):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:           # this launch's own processes only
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = [os.path.join(out, "%s-%d.json" % (variant, r)) for r in range(workers)]
        if all(p.returncode == 0 for p in procs) and all(map(os.path.exists, results)):
            data = []
            for path in results:
                with open(path) as f:
                    data.append(json.load(f))
            return data
        if attempt == 1:
            texts = []
            for log in logs:
                log.seek(0)
                texts.append(log.read()[-1500:])
            raise SystemExit("the %s dist_sync run failed:\n%s" % (variant, "\n".join(
                "--- %s (exit %s)\n%s" % (r, p.returncode, t) for r, p, t in zip(roles, procs, texts))))
    raise AssertionError("unreachable")


def compare(unfused, fused, tolerance):
    """Per-step losses, fused against unfused, per worker; the largest relative difference."""
    worst = 0.0
    for u, f in zip(unfused, fused):
        for a, b in zip(u["losses"], f["losses"]):
            worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
    print("step  " + "  ".join("worker %d: unfused        fused   " % u["rank"] for u in unfused))
    for step in range(len(unfused[0]["losses"])):
        print("%4d  " % step + "  ".join("%16.9f %12.9f" % (u["losses"][step], f["losses"][step])
                                      for u, f in zip(unfused, fused)))
    print("largest relative difference of a loss, fused vs unfused: %.2e (tolerance %.0e)" % (worst, tolerance))
    return worst


def steps_per_second(runs):
    """Median steps/s of the workers' timed steps over all runs of one variant."""
    times = sorted(t for run in runs for worker in run for t in worker["times"])
    return 1.0 / times[len(times) // 2]


def dist_sync_main(args):
    out = tempfile.mkdtemp(prefix="mxfusion-dist-")
    runs = {"unfused": [], "fused": []}
    for _ in range(args.rounds):                 # interleaved: the machine's load touches both alike
        for variant in ("unfused", "fused"):
            runs[variant].append(launch(args, variant, out))
    worst = compare(runs["unfused"][0], runs["fused"][0], args.tolerance)
    u, f = steps_per_second(runs["unfused"]), steps_per_second(runs["fused"])
    print("dist_sync (%s), %d workers, batch %d each: unfused %.2f steps/s, fused %.2f steps/s (%.2fx); median "
          "of %d timed steps per worker and run, %d run(s) each, interleaved"
          % (args.api, len(runs["unfused"][0]), args.batch_size, u, f, f / u, args.steps - args.warmup, args.rounds))
    if worst > args.tolerance:
        raise SystemExit("fused and unfused losses differ by %.2e relative" % worst)


# ---------------------------------------------------------------- Horovod

def horovod_main(args):
    import horovod.mxnet as hvd
    import fusion  # noqa: F401  (after horovod.mxnet here; either order works)

    hvd.init()

    def trainer_for(net):
        hvd.broadcast_parameters(net.collect_params(), root_rank=0)
        return hvd.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": args.lr})

    results = {}
    for _ in range(args.rounds):
        for variant in ("unfused", "fused"):
            losses, times = train(variant, trainer_for, hvd.rank(), args.steps, args.batch_size, args.warmup)
            results.setdefault(variant, []).append([{"rank": hvd.rank(), "losses": losses, "times": times}])
    # every rank's losses and times, gathered to all
    gathered = {}
    for variant, runs in results.items():
        mine = np.array([[x for run in runs for x in run[0]["losses"] + run[0]["times"]]], dtype=np.float64)
        every = hvd.allgather(mx.nd.array(mine, dtype="float64"), name="results_" + variant).asnumpy()
        n = args.steps + (args.steps - args.warmup)
        gathered[variant] = [[{"rank": r, "losses": list(every[r, k * n:k * n + args.steps]),
                               "times": list(every[r, k * n + args.steps:(k + 1) * n])}
                              for r in range(hvd.size())] for k in range(args.rounds)]
    if hvd.rank() == 0:
        worst = compare(gathered["unfused"][0], gathered["fused"][0], args.tolerance)
        u, f = steps_per_second(gathered["unfused"]), steps_per_second(gathered["fused"])
        print("horovod (gloo), %d ranks, batch %d each: unfused %.2f steps/s, fused %.2f steps/s (%.2fx)"
              % (hvd.size(), args.batch_size, u, f, f / u))
        if worst > args.tolerance:
            raise SystemExit("fused and unfused losses differ by %.2e relative" % worst)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--horovod", action="store_true", help="run under horovodrun (gloo) instead of dist_sync")
    p.add_argument("--api", choices=("gluon", "module"), default="gluon",
                   help="dist_sync through gluon.Trainer (default) or MXNet's Module API")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4, help="Adam's learning rate")
    p.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    p.add_argument("--rounds", type=int, default=1, help="runs of each variant, interleaved")
    p.add_argument("--benchmark", action="store_true", help="3 rounds of 40 steps (unless given)")
    p.add_argument("--tolerance", type=float, default=1e-6, help="largest relative loss difference allowed")
    p.add_argument("--quick", action="store_true", help="5 steps (a smoke test)")
    p.add_argument("--variant", choices=("unfused", "fused"), help=argparse.SUPPRESS)   # a worker's
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup = 5, 1
    if args.benchmark:
        args.rounds = max(args.rounds, 3)
        args.steps = max(args.steps, 40)
    if ROLE == "worker":
        worker_main(args)
    elif args.horovod:
        horovod_main(args)
    else:
        dist_sync_main(args)


if __name__ == "__main__":
    main()
