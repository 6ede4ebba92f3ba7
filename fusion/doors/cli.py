"""``mxfuse``: fuse an exported MXNet model on disk.

    mxfuse MODEL-symbol.json [--params MODEL-0000.params] -o OUT_PREFIX
           [--shape data=1,3,224,224 ...] [--verify] [--benchmark] [--explain] [--report report.json]
    mxfuse model.onnx -o OUT_PREFIX [--shape ...] [--to-onnx fused.onnx]
    mxfuse FUSED-symbol.json --params FUSED-0000.params --unfuse -o OUT_PREFIX
    mxfuse MODEL_OR_DIR... -o OUTDIR [-j N] [--reports]       (batch: one process per model,
                                                              fusion/doors/batch.py)

Writes ``OUT_PREFIX-symbol.json`` and ``OUT_PREFIX-0000.params`` (``-o DIR/``
keeps the model's name), with the reports, all at once or not at all
(:mod:`fusion.files.publish`).  Exit status: 0 done, 1 verification failed (nothing
written), 2 bad input or usage (one line on stderr, nothing written), 3 the
``--to-onnx`` export failed (the MXNet model and reports were written — they
were verified —; the ONNX file was not; stderr names the node that stopped the
export), 128 + N stopped by signal N (SIGINT, SIGTERM, SIGHUP; temporary files removed).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
from typing import Any, List, Optional, Tuple

from . import about, progress, serving
from ..api import FusionResult, fuse, unfuse
from .argtypes import memory_size, positive_float, positive_int
from .batch_options import VERBOSE_HELP, add_batch_arguments, batch_only_flags
from ..engine import memory
from ..ir.errors import FusionError
from ..ir.graph import Graph
from ..files.modelio import (model_files, output_paths, parse_shape, read_graph, read_params, text_file, validate_params,
                             weight_variables)
from ..files.publish import check_outputs, prompt_exit, publish, track_temp


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:   # one line, like every other error of mxfuse
        self.exit(2, "mxfuse: error: %s (see mxfuse --help)\n" % message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mxfuse", description="Fuse operators of an exported MXNet model (Symbol JSON + params).")
    p.add_argument("model", help="MODEL-symbol.json, or an ONNX file (model.onnx)")
    p.add_argument("--params", help="MODEL-0000.params (needed for parameter transforms such as BatchNorm folding)")
    p.add_argument("-o", "--output", required=True, help="output prefix: writes OUT-symbol.json and OUT-0000.params; "
                   "a folder (ending in /) keeps the model's name")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2,...",
                   help="input shape, e.g. data=1,3,224,224 (repeatable; needed by --verify and --benchmark)")
    p.add_argument("--rules", help="comma-separated rule or family names (default: all)")
    p.add_argument("--mode", choices=("inference", "training"), default="inference",
                   help="training: only rewrites valid while training (no BatchNorm folding); default inference")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="where the fused model will run: only ops the op library implements there are "
                        "emitted (default cpu; --verify and the self-check still run on this machine's CPU)")
    p.add_argument("--verify", action="store_true", help="compare outputs on random inputs; refuse to write on mismatch")
    p.add_argument("--inputs", metavar="FILE.npz", help="verify on these inputs (arrays named like the model's inputs)")
    p.add_argument("--rtol", type=positive_float, default=None,
                   help="tolerance of --verify: max|Δ|/max|orig| (default 1e-4; 2e-2 with --precision bf16)")
    p.add_argument("--precision", default="float32", metavar="{float32,bf16}",
                   help="bf16: the fused ops' matrix products in bfloat16 (weights cast once, float32 "
                        "accumulation; inference only; needs a CPU with avx512_bf16/amx_bf16)")
    p.add_argument("--force-precision", action="store_true",
                   help="--precision bf16 even on a CPU without native bfloat16 (emulated: slower)")
    p.add_argument("--benchmark", action="store_true", help="time the original and the fused model (medians)")
    p.add_argument("--repeats", type=positive_int, default=20,
                   help="timed rounds of --benchmark, after as many untimed ones up to 3 (default 20)")
    p.add_argument("--no-self-check", dest="self_check", action="store_false",
                   help="skip the per-rewrite self-check (each rewrite run against what it replaces on random "
                        "inputs at the --shape sizes and at other sizes the model accepts; on by default)")
    p.add_argument("--max-memory", metavar="SIZE", type=memory_size,
                   help="the most memory the checks (self-check, --verify, --benchmark) may hold at once, e.g. 4G "
                        "or 500M: where one would need more it runs smaller and the report says how; where it "
                        "cannot, mxfuse stops before writing (exit status 2) (default: 60 percent of the memory "
                        "available; in batch mode, shared among the models fused at once)")
    p.add_argument("--explain", action="store_true", help="also list near-misses: partial matches and why they failed")
    p.add_argument("--report", metavar="FILE.json", help="write the report as JSON")
    p.add_argument("--unfuse", action="store_true",
                   help="rewrite fused_* ops back into stock MXNet ops (the result loads without mxnet-fusion)")
    p.add_argument("--to-onnx", metavar="OUT.onnx",
                   help="also export the fused model to ONNX, validated in ONNX Runtime (needs --shape); if "
                        "only this export fails, the MXNet files are still written and the exit status is 3")
    p.add_argument("--onnx-target", choices=("ort", "standard"), default="ort",
                   help="fused ops as ONNX Runtime's contrib ops (ort: Attention, SkipLayerNormalization, "
                        "BiasGelu, ...; the default) or as standard ONNX ops only (standard)")
    p.add_argument("--opset", type=int, metavar="N",
                   help="ONNX opset of --to-onnx, 13-21 (default: the input ONNX file's opset, else 17)")
    p.add_argument("--html", metavar="FILE.html", help="write a readable HTML report with drawings of both graphs")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("--list-rules", action=about.ListRulesAction,
                   help="list the rules (name, family, inference only or not, what each matches) and exit")
    p.add_argument("--version", action=about.VersionAction, help="print the versions of mxfuse and MXNet and exit")
    add_batch_arguments(p)
    return p


def options_table(parser: Optional[argparse.ArgumentParser] = None) -> str:
    """mxfuse's options as a Markdown table (option | meaning), rendered from ``build_parser()``:
    README.md shows it, tests/test_docs.py keeps the two equal."""
    parser = parser or build_parser()
    rows = ["| option | meaning |", "|---|---|"]
    for group in parser._action_groups:
        batch = group.title.startswith("batch mode")
        for a in group._group_actions:
            if a.help == argparse.SUPPRESS or "-h" in a.option_strings:
                continue
            value = a.metavar or ("{%s}" % ",".join(a.choices) if a.choices else a.dest.upper())
            option = value if not a.option_strings else ", ".join(a.option_strings) + ("" if a.nargs == 0 else " " + value)
            meaning = (a.help or "") % {**vars(a), "prog": parser.prog} if "%(" in (a.help or "") else (a.help or "")
            if a.option_strings and a.nargs != 0 and a.default not in (None, [], argparse.SUPPRESS) \
                    and "default" not in meaning:
                meaning += " (default %s)" % a.default
            rows.append("| `%s` | %s%s |" % (option, "batch mode: " if batch else "", meaning.replace("|", "\\|")))
    return "\n".join(rows)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwind like Ctrl-C, so that temporary files are removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, frame) -> None:
    raise Terminated(signum)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    args = parser.parse_args(argv)
    if batch_only_flags(args):
        parser.error(batch_only_flags(args))
    args.command_line = argv
    published: List[str] = []
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, _terminate)
        except (ValueError, OSError):     # not the main thread: leave signals alone
            pass
    try:
        # a signal ends the run within a second and a half even inside one long native call (MXNet
        # running a large model), temporary files removed (publish.prompt_exit)
        with prompt_exit(GRACE_SECONDS, lambda signum: _stopped(signum, published)), \
                progress.session(verbose=args.verbose, quiet=args.quiet), _report_only_on_stdout():
            return _run(args, published)
    except FusionError as e:
        print("mxfuse: error: %s" % e, file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
        print(_stopped(signum, published), file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _flush_stdout()


#: Where _say writes: the stdout mxfuse was started with, while Python's own stdout is a sink for
#: what MXNet prints (every argument of a shape inference that failed, which the engine does on
#: purpose while it probes shapes): stdout carries the report alone.
_REPORT_STREAM: List[Any] = []


class _Chatter(io.TextIOBase):
    """A sink that counts the lines written to it (kept for the JSON report, not shown)."""

    def __init__(self):
        super().__init__()
        self.lines = 0
        self.first: List[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                self.lines += 1
                if len(self.first) < 3:
                    self.first.append(line.strip()[:200])
        return len(text)


@contextlib.contextmanager
def _report_only_on_stdout():
    chatter = _Chatter()
    _REPORT_STREAM.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(chatter):
            yield chatter
    finally:
        _REPORT_STREAM.pop()


def _chatter_of_mxnet() -> Optional[dict]:
    sink = sys.stdout
    if isinstance(sink, _Chatter) and sink.lines:
        return {"lines": sink.lines, "first": list(sink.first)}
    return None


#: How long the main thread has to unwind after a signal before the process is ended for it.
GRACE_SECONDS = 1.5


def _stopped(signum: int, published: List[str]) -> str:
    what = "interrupted" if signum == signal.SIGINT else "terminated by %s" % signal.Signals(signum).name
    return "mxfuse: %s%s" % (what, "; wrote %s" % ", ".join(published) if published else "; nothing written")


def _say(text: str) -> None:
    """Print to stdout; a reader that went away (``mxfuse ... | head``) does not stop the run."""
    out = _REPORT_STREAM[-1] if _REPORT_STREAM else sys.stdout
    try:
        print(text, file=out)
    except BrokenPipeError:
        _stdout_to_devnull()


def _flush_stdout() -> None:
    try:
        (_REPORT_STREAM[-1] if _REPORT_STREAM else sys.stdout).flush()
    except BrokenPipeError:
        _stdout_to_devnull()
    except (OSError, ValueError):
        pass


def _stdout_to_devnull() -> None:
    # What Python's docs advise: later writes (and the flush at exit) go nowhere instead of
    # raising again, and no "Exception ignored ... BrokenPipeError" is printed at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, (_REPORT_STREAM[-1] if _REPORT_STREAM else sys.stdout).fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _outputs(args: argparse.Namespace) -> List[Tuple[str, str]]:
    """(what, path) of every file the run writes."""
    sym_path, params_path = output_paths(args.output, args.model)
    outputs = [("the model's symbol file", sym_path), ("the model's params file", params_path)]
    for flag in ("to_onnx", "report", "html"):
        if getattr(args, flag) is not None:
            outputs.append(("--" + flag.replace("_", "-"), getattr(args, flag)))
    return outputs


def _refuse_without_weights(args: argparse.Namespace, graph: Graph, symbol: Any, shapes: dict) -> None:
    """A model with weights and no --params: --verify and --benchmark cannot run it, and the files
    written would hold a model that cannot run either (its params file empty)."""
    weights = weight_variables(graph, symbol, shapes)
    if not weights:
        return
    some = ", ".join(weights[:3]) + (", …" if len(weights) > 3 else "")
    for flag in ("verify", "benchmark"):
        if getattr(args, flag):
            raise FusionError("--%s needs --params: %d weight%s no values (%s)"
                              % (flag, len(weights), "s have" if len(weights) > 1 else " has", some))
    raise FusionError("no --params: the model has %d weight%s (%s) and the files written would hold none; "
                      "pass --params MODEL-0000.params" % (len(weights), "s" if len(weights) > 1 else "", some))


def _run(args: argparse.Namespace, published: List[str]) -> int:
    protect = [args.model, args.params]
    check_outputs(_outputs(args), protect)      # before any work: a bad path fails now, not after fusing
    paths = output_paths(args.output, args.model)
    shapes: dict = {}
    for text in args.shape:
        name, shape = parse_shape(text)
        if name in shapes:
            raise FusionError("--shape gives '%s' twice (%s and %s)" % (name, ",".join(map(str, shapes[name])),
                                                                     ",".join(map(str, shape))))
        shapes[name] = shape
    if (args.verify or args.benchmark) and not shapes and not args.inputs:
        raise FusionError("--verify and --benchmark need the input shapes: add --shape NAME=D1,D2,...")
    if args.model.lower().endswith(".onnx"):
        if args.params:
            raise FusionError("an ONNX file carries its own weights; drop --params")
        from ..onnx.importer import import_onnx
        symbol, arg, aux = import_onnx(args.model, input_shapes=shapes)
        graph = Graph.from_symbol(symbol)
    else:
        graph = read_graph(args.model)
        symbol = graph.to_symbol()
        arg, aux = read_params(args.params) if args.params else ({}, {})
    unknown_inputs = [n for n in shapes if n not in symbol.list_arguments()]
    if unknown_inputs:
        raise FusionError("--shape names %s, which is not an input of the graph (inputs: %s)"
                          % (", ".join(unknown_inputs), ", ".join(n for n in symbol.list_arguments() if n not in arg)))
    given = [n for n in shapes if n in arg]
    if given:
        raise FusionError("--shape names %s, which is a parameter in the params file, not an input" % ", ".join(given))
    if not args.params and not args.model.lower().endswith(".onnx"):
        _refuse_without_weights(args, graph, symbol, shapes)
    inputs = None
    if args.inputs:
        from ..check.verify import load_inputs
        inputs = load_inputs(args.inputs, symbol, arg, aux, shapes)
        shapes = {k: tuple(v.shape) for k, v in inputs.items()}
    validate_params(graph, symbol, arg, aux, shapes)

    if args.to_onnx and not shapes:
        raise FusionError("--to-onnx needs the input shapes: add --shape NAME=D1,D2,...")
    onnx_options = _onnx_options(args, symbol, arg) if args.to_onnx else {}
    rules = [r.strip() for r in args.rules.split(",") if r.strip()] if args.rules else None
    from ..precision.policy import FLOAT32, resolve, tolerance
    precision = resolve(args.precision, args.force_precision or args.device == "gpu", args.mode)
    from ..api import check_device_precision
    check_device_precision(args.device, precision)
    rtol_given = args.rtol is not None
    if args.rtol is None:
        args.rtol = tolerance(precision)
    if precision != FLOAT32 and (args.unfuse or args.to_onnx):
        raise FusionError("--precision %s takes no %s (stock MXNet ops and ONNX get the float32 model)"
                          % (args.precision, "--unfuse" if args.unfuse else "--to-onnx"))
    budget = memory.budget(args.max_memory, door="cli")
    _plan_checks(args, symbol, arg, aux, shapes, budget)    # a check that cannot fit stops here, before fusing
    if args.unfuse:
        if args.rules or args.benchmark:
            raise FusionError("--unfuse takes no --rules or --benchmark")
        with progress.stage("unfusing"):
            result = _unfused_result(symbol, arg, aux, shapes)
    else:
        with progress.stage("fusing"):
            result = fuse(symbol, arg, aux, rules=rules, mode=args.mode, input_shapes=shapes,
                          self_check=args.self_check, precision=precision, force=True, device=args.device,
                          max_memory=budget)
    report = result.report
    _warn_miscomputed(report)
    if not rtol_given:          # an AMP-converted model is fused as precision='bf16' (fusion/precision/policy.py)
        args.rtol = tolerance(report.precision)
    report.extra.update(about.run_info(getattr(args, "command_line", None), shapes))
    status = 0
    if args.verify:
        from ..check.verify import verify
        with progress.stage("verifying"):
            v = verify((symbol, arg, aux), result, input_shapes=shapes, inputs=inputs, max_memory=budget)
        report.extra["verify"] = v.to_dict(args.rtol)
        if not v.ok(args.rtol):
            status = 1
    if status == 0:     # how to load the files, only where they will be written
        serving.add_note(report, result.graph, paths[0][: -len("-symbol.json")])
    if args.benchmark and status == 0 and report.precision == "float16":
        why = ("--benchmark not run: the model is float16 for the GPU, and MXNet's CPU, which --benchmark times "
               "on, has no float16 FullyConnected; time it on the GPU")
        report.notes.append(why)
        print("mxfuse: warning: %s" % why, file=sys.stderr)
    elif args.benchmark and status == 0:
        with progress.stage("benchmarking"):
            noted = len(budget.notes)
            report.extra["benchmark"] = _benchmark(symbol, arg, aux, result, shapes, args.repeats, budget)
            report.notes.extend(budget.notes[noted:])
    report.extra["memory"] = budget.to_dict()
    chatter = _chatter_of_mxnet()
    if chatter:     # what MXNet printed while shapes were probed: kept out of stdout, counted here
        report.extra["mxnet_stdout"] = chatter
    if not args.quiet:
        _say(report.to_text(explain=args.explain))
    if status:
        print("mxfuse: error: %s; nothing written" % report.extra["verify"]["failure"], file=sys.stderr)
        return status
    onnx_said: List[str] = []
    files = []
    staged = None
    onnx_error = None
    try:
        if args.to_onnx:        # first: a fallback to the un-fused form adds a note to the report
            import tempfile

            from ..files.publish import temp_prefix
            fd, staged = tempfile.mkstemp(prefix=temp_prefix(), suffix=".onnx",
                                          dir=_nearest_folder(args.to_onnx))
            os.close(fd)
            track_temp(staged)
            try:
                with progress.stage("exporting to ONNX"):
                    onnx_said.append(_export_onnx(result, shapes, staged, onnx_options))
            except FusionError as e:
                onnx_error = str(e)
                report.notes.append("ONNX export failed: %s" % onnx_error)
            except Exception as e:      # an exporter's own failure: the verified MXNet model is still written
                onnx_error = "ONNX export failed: %s: %s" % (type(e).__name__, str(e).strip().split("\n")[0])
                report.notes.append(onnx_error)
            else:
                import shutil
                files.append(("--to-onnx", args.to_onnx, lambda tmp: shutil.copyfile(staged, tmp)))
        files += model_files(paths, result.symbol, result.arg_params, result.aux_params)
        if args.report:
            files.append(text_file("--report", args.report, report.to_json))
        if args.html:
            from .html_report import render_html
            files.append(text_file("--html", args.html, lambda: render_html(
                graph, result, title=os.path.basename(args.model), inputs=list(shapes) or None)))
        publish(files, inputs=protect, published=published)
    finally:
        if staged is not None and os.path.exists(staged):
            os.unlink(staged)
        if staged is not None:
            track_temp(staged, live=False)
    if onnx_error is not None:
        if not args.quiet:
            _say("wrote %s and %s" % paths)
        print("mxfuse: error: %s; %s not written (the MXNet model was written)" % (onnx_error, args.to_onnx),
              file=sys.stderr)
        return 3
    if not args.quiet:
        if args.to_onnx:
            _say("wrote %s (ONNX Runtime vs MXNet: %s)" % (args.to_onnx, onnx_said[0]))
        _say("wrote %s and %s" % paths)
    return 0


def _warn_miscomputed(report) -> None:
    """One stderr line when MXNet's own default bind computes the input model wrong (the report has the note)."""
    places = report.extra.get("mxnet_miscomputes_original")
    if places:
        progress.message("mxfuse: warning: MXNet's default bind computes the input model wrong at %d layer "
                         "output(s) that are also outputs or read elsewhere (%s); the written model does not "
                         "(see the report)" % (len(places), ", ".join(places[:3]) + (" …" if len(places) > 3 else "")))


def _nearest_folder(path: str) -> str:
    """The folder of ``path``, or the nearest one above it that exists: the export is staged there
    (publish() creates the missing folders when it writes the files, as for -o)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def _onnx_options(args, symbol, arg) -> dict:
    """export_onnx's target, opset (given, or the input ONNX file's) and input dtypes (those of the input
    ONNX file: token ids stay int64)."""
    from ..onnx.export import DEFAULT_OPSET, OPSET_RANGE, onnx_opset_of

    lo, hi = OPSET_RANGE
    if args.opset is not None and not lo <= args.opset <= hi:
        raise FusionError("--opset %d: the exporter writes opsets %d-%d" % (args.opset, lo, hi))
    options = {"target": args.onnx_target, "opset": args.opset}
    if args.model.lower().endswith(".onnx"):
        if args.opset is None:
            found = onnx_opset_of(args.model)
            options["opset"] = min(max(found, lo), hi) if found else DEFAULT_OPSET
        import re

        import onnx
        from onnx import helper
        model = onnx.load(args.model, load_external_data=False)
        inits = {t.name for t in model.graph.initializer}
        names = set(symbol.list_arguments()) - set(arg)
        dtypes, io_names = {}, {}
        for i in model.graph.input:
            if i.name in inits:
                continue
            name = re.sub(r"[^A-Za-z0-9_]", "_", i.name).strip("_") or "node"
            name = "v" + name if name[0].isdigit() else name
            elem = i.type.tensor_type.elem_type
            if name in names:
                io_names[name] = i.name
                if elem not in (0, onnx.TensorProto.FLOAT):
                    dtypes[name] = helper.tensor_dtype_to_np_dtype(elem)
        if len(model.graph.output) == len(symbol.list_outputs()):     # the file's output names, in order
            io_names.update(zip(symbol.list_outputs(), (o.name for o in model.graph.output)))
        options["input_dtypes"] = dtypes
        options["names"] = io_names
    return options


def _unfused_result(symbol, arg, aux, shapes) -> FusionResult:
    from ..engine.report import FusionReport

    plain = unfuse(symbol, shapes, arg, aux)
    g = Graph.from_symbol(symbol)
    report = FusionReport(mode="inference", ops_before=len(g.op_nodes()), nodes_before=len(g.nodes))
    g2 = Graph.from_symbol(plain)
    report.ops_after, report.nodes_after = len(g2.op_nodes()), len(g2.nodes)
    report.notes.append("unfused: every fused_* op rewritten into stock MXNet ops")
    # a fused op's inputs are arguments; the stock op may read some as auxiliary states (a region's
    # BatchNorm statistics): the params files say which is which as the un-fused symbol reads them
    aux_names = set(plain.list_auxiliary_states())
    params = {**arg, **aux}
    arg = {k: v for k, v in params.items() if k not in aux_names}
    aux = {k: v for k, v in params.items() if k in aux_names}
    return FusionResult(plain, arg, aux, report, g2)


def _export_onnx(result, shapes, path: str, options: dict) -> str:
    """Export ``result`` to the ONNX file ``path``; what ONNX Runtime vs MXNet said."""
    from ..onnx.export import OnnxExportError, export_onnx

    symbol = result.symbol
    try:
        v = export_onnx(symbol, result.arg_params, result.aux_params, shapes, path, **options)
    except OnnxExportError as e:
        if not str(e.op or "").startswith("fused_"):
            raise
        # a fused op ONNX has no form for: export that model un-fused instead
        try:
            symbol = unfuse(symbol, shapes, result.arg_params, result.aux_params)
        except FusionError:
            raise e from None
        v = export_onnx(symbol, result.arg_params, result.aux_params, shapes, path, **options)
        result.report.notes.append("ONNX export: %s; exported the un-fused form" % e)
    return str(v)


def _plan_checks(args: argparse.Namespace, symbol, arg, aux, shapes: dict, budget) -> None:
    """The memory plans of --verify and --benchmark from the original model's shapes, before anything
    runs: where even the smallest would not fit, the one-line error (exit status 2) comes now, not
    after fusing.  (The self-check plans each rewrite as it comes: fusion/engine/selfcheck.py.)"""
    import dataclasses

    if not shapes or budget.limit is None:
        return
    scratch = dataclasses.replace(budget, notes=[], estimates={})
    if args.verify:
        from ..check.verify import verify_plan
        verify_plan((symbol, arg, aux), shapes, scratch)
    if args.benchmark and not args.unfuse:
        from ..check.bench import benchmark_plan
        benchmark_plan(symbol, arg, aux, None, shapes, scratch)


def _benchmark(symbol, arg, aux, result, shapes, repeats: int, budget=None) -> dict:
    from ..check.bench import benchmark
    from ..check.verify import random_inputs

    figures = benchmark(symbol, arg, aux, result, random_inputs(symbol, arg, shapes), repeats, warmup=min(3, repeats),
                        max_memory=budget)
    progress.benchmark_warnings(figures)
    return figures


if __name__ == "__main__":
    sys.exit(main())
