"""Shared test helpers.  Thread settings are applied before mxnet is imported (see fusion/native/env.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("MXFUSION_AUTOBUILD", "1")    # build the fused-op library if missing or stale

from fusion.native import env as _env  # noqa: E402

_env.configure_threads()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

RTOL = 1e-4   # max|fused - original| / max|original|, fp32


def random_params(sym, input_shapes, seed=0, inputs=None):
    """Random arg/aux params for ``sym``: normal weights, BatchNorm stats with positive variance.

    ``inputs`` names the data inputs (default: the keys of ``input_shapes``, which may also
    give shapes of parameters MXNet cannot infer).
    """
    import mxnet as mx

    rng = np.random.default_rng(seed)
    inputs = set(input_shapes if inputs is None else inputs)
    arg_shapes, _, aux_shapes = sym.infer_shape(**input_shapes)
    arg = {}
    for name, shape in zip(sym.list_arguments(), arg_shapes):
        if name in inputs:
            continue
        if name.endswith("gamma"):
            arg[name] = mx.nd.array(rng.uniform(0.5, 1.5, shape))
        else:
            arg[name] = mx.nd.array(rng.normal(0, 0.5, shape))
    aux = {}
    for name, shape in zip(sym.list_auxiliary_states(), aux_shapes):
        if name.endswith("var"):
            aux[name] = mx.nd.array(rng.uniform(0.5, 2.0, shape))
        else:
            aux[name] = mx.nd.array(rng.normal(0, 0.3, shape))
    return arg, aux


@pytest.fixture
def no_regions(monkeypatch):
    """The rules as they run where the op library has no fused_region: for the tests of the CNN block
    rules (and of what surrounds them), whose blocks a region takes where it can (tests/test_region.py
    tests regions)."""
    from fusion.native import library
    caps = {op: c for op, c in library.capabilities().items() if op != "fused_region"}
    monkeypatch.setattr(library, "_capabilities", caps)     # what capabilities() answers (tests/test_device.py too)


def fuse_and_check(sym, input_shapes, arg=None, aux=None, rtol=RTOL, **kwargs):
    """Fuse with params (random ones unless given) and assert outputs match the original."""
    import fusion

    if arg is None:
        arg, aux = random_params(sym, input_shapes)
    kwargs.setdefault("input_shapes", {k: v for k, v in input_shapes.items() if k not in arg})
    result = fusion.fuse(sym, arg, aux, **kwargs)
    v = fusion.verify(sym, result, (arg, aux), input_shapes)
    assert v.max_rel <= rtol, (v, result.report.to_text())
    return result


def ops(result_or_sym):
    """Op name -> count in a FusionResult's graph or a Symbol."""
    from fusion.ir.graph import Graph

    g = result_or_sym.graph if hasattr(result_or_sym, "graph") else Graph.from_symbol(result_or_sym)
    return g.count_ops()


def assert_unfuse_round_trip(sym, arg, aux, res, shapes, op, rtol=1e-5, **fuse_kwargs):
    """``unfuse`` of the fused graph ``res`` leaves stock ops only, computes what ``sym`` computes,
    and fusing it again gives one ``op`` back (``op`` None: not checked)."""
    import fusion

    plain = fusion.unfuse(res.symbol)
    assert not any(o.startswith("fused_") for o in ops(plain)), ops(plain)
    v = fusion.verify(sym, (plain, res.arg_params, res.aux_params), (arg, aux), shapes)
    assert v.max_rel <= rtol, v
    if op is not None:
        again = fusion.fuse(plain, res.arg_params, res.aux_params, input_shapes=shapes, **fuse_kwargs)
        assert ops(again).get(op) == 1, again.report.to_text(explain=True)


@pytest.fixture
def tmp_model(tmp_path):
    """Write a small Conv-BN-ReLU model to disk; returns (symbol path, params path)."""
    def write(sym=None, arg=None, aux=None, name="model"):
        import mxnet as mx

        if sym is None:
            sym = small_cnn()
        if arg is None:
            arg, aux = random_params(sym, {"data": (1, 3, 8, 8)})
        sp, pp = tmp_path / (name + "-symbol.json"), tmp_path / (name + "-0000.params")
        sym.save(str(sp))
        mx.nd.save(str(pp), {**{"arg:" + k: v for k, v in arg.items()}, **{"aux:" + k: v for k, v in aux.items()}})
        return sp, pp
    return write


def small_cnn():
    import mxnet as mx

    x = mx.sym.var("data")
    y = mx.sym.Convolution(x, num_filter=4, kernel=(3, 3), pad=(1, 1), name="conv0")
    y = mx.sym.BatchNorm(y, fix_gamma=False, eps=1e-5, name="bn0")
    y = mx.sym.Activation(y, act_type="relu", name="relu0")
    y = mx.sym.Convolution(y, num_filter=4, kernel=(1, 1), no_bias=True, name="conv1")
    y = mx.sym.BatchNorm(y, name="bn1")
    return mx.sym.Pooling(y, kernel=(1, 1), global_pool=True, pool_type="avg", name="pool")


def run_mxfuse(capsys, *argv):
    """(exit status, stdout, stderr) of an in-process mxfuse run; argparse's exits included."""
    from fusion.doors import mxfuse

    try:
        code = mxfuse.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# Once in six full runs, the test process aborted after every test had passed and pytest had
# printed its summary ("terminate called without an active exception" during C++ static
# destruction at interpreter exit; MXNet's engine threads are alive then).  The cause is not
# found.  The process therefore leaves with pytest's own exit status once MXNet's queued work is
# done, without running the C++ static destructors.
_EXIT_STATUS = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


def _leave_without_static_destructors():
    if not _EXIT_STATUS:
        return
    try:
        import mxnet as mx
        mx.nd.waitall()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[-1])


import atexit  # noqa: E402

atexit.register(_leave_without_static_destructors)
