"""README.md and docs/*.md keep to the code.

* README.md is a front page: at most 200 lines, with its table of what to expect (each row names the
  CPU it was measured on and links the benchmark that measured it).
* README.md's table of mxfuse options is the one ``fusion.doors.cli.options_table()`` renders from
  the argument parser (every option, its help as ``mxfuse --help`` prints it).
* Every relative link points at a file that exists (and at a heading of it, where it names one);
  every repository path written in backticks exists (build outputs aside).
* No sentence is written twice across README.md and docs/ (each topic lives in one place).
* Code blocks run as written.  A fenced block's language says what it is: ``sh`` and ``python``
  blocks are commands, run by this test; other languages (``text``: output shown) are not run.  A
  command block preceded directly by an HTML comment ``<!-- not run: REASON -->`` is not run (set-up,
  GPU, Horovod, long benchmarks); its scripts must still exist and its ``mxfuse`` options must be
  ones the parser knows.  Each block runs on its own, in a fresh folder holding the project's
  ``examples/``, ``benchmarks/`` and ``tools/`` (so ``examples/models/mobilenetv2_0.25-*``, the bundled
  model, is where the README says), with ``python`` and ``mxfuse`` being this environment's and
  importing this checkout — as after the README's ``. .venv/bin/activate``.
"""
import glob
import json
import os
import re
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FILES = [README] + DOCS
RUN = ("sh", "python")
SHOWN = ("text", "json")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$", re.S)
LINKED = ("examples", "benchmarks", "tools")     # what a block's folder holds of the project
TIMEOUT = 300


def _rel(path):
    return os.path.relpath(path, ROOT)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def blocks(path):
    """[(line, language, code, reason it is not run or None)] of the fenced blocks of ``path``."""
    lines = _read(path).splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        assert j < len(lines), "%s:%d: a code block is not closed" % (_rel(path), start + 1)
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        comment = lines[before].strip() if before >= 0 else ""
        k = before       # an HTML comment may span lines: find where it opens
        while comment.endswith("-->") and not comment.startswith("<!--") and k > 0:
            k -= 1
            comment = lines[k].strip() + " " + comment
        marker = NOT_RUN.match(comment)
        out.append((start + 1, lang, "\n".join(lines[start + 1:j]), marker.group(1) if marker else None))
        i = j + 1
    return out


def prose(path):
    """The text of ``path`` outside code blocks, tables and HTML comments."""
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("|"))


ALL_BLOCKS = [(path, line, lang, code, reason) for path in FILES for line, lang, code, reason in blocks(path)]
RUNNABLE = [b for b in ALL_BLOCKS if b[2] in RUN and b[4] is None]


# ---------------------------------------------------------------- the front page

def test_readme_is_a_front_page():
    lines = _read(README).splitlines()
    assert len(lines) <= 200, "README.md has %d lines; move detail into docs/" % len(lines)
    for heading in ("## What you can expect", "## Three doors", "## Guarantees", "## Where to go next"):
        assert heading in lines, "README.md lacks %r" % heading


def test_expectations_table_names_a_cpu_and_a_benchmark_per_row():
    text = _read(README)
    section = text[text.index("## What you can expect"):text.index("## Three doors")]
    rows = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    cpu, bench = header.index("CPU"), header.index("benchmark")
    assert len(rows) > 4
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(header), row
        assert re.search(r"EPYC|Xeon|Core|Ryzen|Graviton|Apple", cells[cpu]), "no CPU named: " + row
        assert re.search(r"\]\((benchmarks|examples)/\S+\.py\)", cells[bench]), "no benchmark linked: " + row


def test_readme_options_table_is_the_parsers():
    from fusion.doors.cli import build_parser, options_table

    text = _read(README)
    want = options_table()
    assert want in text, ("README.md's mxfuse options table differs from the parser's; paste the output of\n"
                          "  python -c 'from fusion.doors.cli import options_table; print(options_table())'\n"
                          "in its place:\n" + want)
    rows = {}
    for option, meaning in re.findall(r"^\| `([^`]+)` \| (.*) \|$", text, re.M):
        for name in option.replace(",", " ").split():
            rows.setdefault(name, meaning)
    for action in build_parser()._actions:
        if "-h" in action.option_strings:
            continue
        names = action.option_strings or [action.metavar or action.dest.upper()]
        assert action.help, "mxfuse %s has no help" % "/".join(names)
        for name in names:
            assert name in rows, "README.md's options table lacks mxfuse %s" % name
            assert action.help.replace("|", "\\|") in rows[name], "README.md: mxfuse %s is not described by its help" % name


# ---------------------------------------------------------------- links and paths

def _slug(heading):
    heading = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path):
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", _read(path), flags=re.S),
                                                    re.M)}


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_relative_links_resolve(path):
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            broken.append(target)
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            broken.append(target + " (no such heading)")
    assert not broken, "%s: links that do not resolve: %s" % (_rel(path), ", ".join(broken))


TOP = ("fusion", "patterns", "tests", "tools", "benchmarks", "examples", "cuda_kernels", "docs")


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_paths_in_backticks_exist(path):
    missing = []
    for token in re.findall(r"`([^`\s]+)`", prose(path)):
        token = token.rstrip(".,:;")
        if token.split("/")[0] not in TOP or "/" not in token or "<" in token or "…" in token:
            continue
        if token.startswith("fusion/_lib/"):      # what the build makes
            continue
        token = token.split(":")[0]
        if not glob.glob(os.path.join(ROOT, token)):
            missing.append(token)
    assert not missing, "%s names files that do not exist: %s" % (_rel(path), ", ".join(sorted(set(missing))))


def test_no_sentence_is_written_twice():
    seen = {}
    twice = []
    for path in FILES:
        text = re.sub(r"\s+", " ", prose(path))
        for sentence in re.split(r"(?<=[.!?:])\s+(?=[A-Z*`(])", text):
            sentence = sentence.strip()
            if len(sentence) < 80:
                continue
            if sentence in seen and seen[sentence] != path:
                twice.append("%s and %s: %s" % (_rel(seen[sentence]), _rel(path), sentence[:100]))
            seen.setdefault(sentence, path)
    assert not twice, "written twice:\n  " + "\n  ".join(twice)


# ---------------------------------------------------------------- code blocks

def test_blocks_say_what_they_are():
    wrong = ["%s:%d: ```%s" % (_rel(p), line, lang) for p, line, lang, _, _ in ALL_BLOCKS
             if lang not in RUN + SHOWN]
    assert not wrong, "code blocks need a language (%s run; %s are shown): %s" % (
        "/".join(RUN), "/".join(SHOWN), ", ".join(wrong))
    unexplained = ["%s:%d" % (_rel(p), line) for p, line, lang, _, reason in ALL_BLOCKS
                   if reason is not None and not reason.strip()]
    assert not unexplained, "'not run' without a reason: " + ", ".join(unexplained)
    assert any(_rel(p) == "README.md" and lang == "sh" for p, _, lang, _, _ in RUNNABLE)
    assert any(_rel(p) == "README.md" and lang == "python" for p, _, lang, _, _ in RUNNABLE)


def _commands(code):
    """Shell commands of a block, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [re.sub(r"\s+#.*$", "", ln).strip() for ln in joined.splitlines() if ln.strip() and not ln.startswith("#")]


def test_commands_not_run_still_name_what_exists():
    from fusion.doors.cli import build_parser

    known = {s for a in build_parser()._actions for s in a.option_strings}
    wrong = []
    for path, line, lang, code, _ in ALL_BLOCKS:
        if lang != "sh":
            continue
        for cmd in _commands(code):
            words = cmd.split()
            for w in words:
                if re.match(r"^(examples|benchmarks|tools)/\S+\.py$", w) and not os.path.exists(os.path.join(ROOT, w)):
                    wrong.append("%s:%d: %s does not exist" % (_rel(path), line, w))
            if "mxfuse" in words:
                for opt in re.findall(r"(?<!\S)(--?[a-z][\w-]*)", cmd[cmd.index("mxfuse"):]):
                    if opt not in known:
                        wrong.append("%s:%d: mxfuse has no option %s" % (_rel(path), line, opt))
            script = next((w for w in words if w.endswith(".py")), None)
            if words[:1] in (["python"], ["python3"]) and script and os.path.exists(os.path.join(ROOT, script)):
                source = _read(os.path.join(ROOT, script))
                for opt in re.findall(r"(?<!\S)(--[a-z][\w-]*)", cmd.split(script, 1)[1]):
                    if '"%s"' % opt not in source:
                        wrong.append("%s:%d: %s has no option %s" % (_rel(path), line, script, opt))
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def shims(tmp_path_factory):
    """A bin folder with ``python`` and ``mxfuse`` of this environment, importing this checkout."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, args in (("python", ""), ("python3", ""), ("mxfuse", " -m fusion.doors.mxfuse")):
        shim = bin_dir / name       # a script, not a link: a venv's python finds its venv by its own path
        shim.write_text('#!/bin/sh\nexec "%s"%s "$@"\n' % (sys.executable, args))
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return str(bin_dir)


def _folder(root, path, line):
    folder = os.path.join(str(root), "%s-%d" % (_rel(path).replace("/", "-"), line))
    os.makedirs(folder)
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), os.path.join(folder, name))
    return folder


def _env(shims):
    return dict(os.environ, PATH=shims + os.pathsep + os.environ.get("PATH", ""),
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


#: Runs Python blocks one after the other in one process (importing MXNet once, not once a block):
#: each as ``python block.py`` would, in its own folder and namespace; a JSON line per block.
RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback
for folder in sys.argv[1:]:
    os.chdir(folder)
    out, err, error = io.StringIO(), io.StringIO(), None
    sys.argv, sys.path[0] = ["block.py"], folder        # as `python block.py` has them
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path("block.py", run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                error = "SystemExit(%r)" % (e.code,)
        except BaseException:
            error = traceback.format_exc()
    print(json.dumps({"folder": folder, "error": error, "stdout": out.getvalue()[-3000:],
                      "stderr": err.getvalue()[-3000:]}), flush=True)
"""


def _run_python_blocks(items, shims):
    """{folder: (error or None, output)} of Python blocks ``items`` [(folder, code)], run by RUNNER."""
    for folder, code in items:
        with open(os.path.join(folder, "block.py"), "w") as f:
            f.write(code + "\n")
    p = subprocess.run([os.path.join(shims, "python"), "-c", RUNNER] + [f for f, _ in items], env=_env(shims),
                       capture_output=True, text=True, timeout=TIMEOUT * 2)
    done = {}
    for ln in p.stdout.splitlines():
        if ln.startswith("{"):
            r = json.loads(ln)
            done[r["folder"]] = (r["error"], r["stdout"] + r["stderr"])
    for folder, _ in items:       # the runner died (a crash in native code) before this block said anything
        done.setdefault(folder, ("the runner ended (exit %d) before this block finished:\n%s"
                                 % (p.returncode, p.stderr[-3000:]), ""))
    return done


def _run_shell_block(code, shims, folder):
    p = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=folder, env=_env(shims),
                       capture_output=True, text=True, timeout=TIMEOUT)
    return (None if p.returncode == 0 else "exit status %d" % p.returncode), p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def block_runs(request, shims, tmp_path_factory):
    """What the blocks this session runs gave, by (path, line): the Python blocks in one process, the
    shell blocks one process each, both at once."""
    from concurrent.futures import ThreadPoolExecutor

    wanted = [item.callspec.params for item in request.session.items
              if getattr(item, "originalname", None) == "test_block_runs_as_written"]
    root = tmp_path_factory.mktemp("blocks")
    folders = {(p["path"], p["line"]): _folder(root, p["path"], p["line"]) for p in wanted}
    python = [(folders[(p["path"], p["line"])], p["code"]) for p in wanted if p["lang"] == "python"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        python_done = pool.submit(_run_python_blocks, python, shims) if python else None
        futures = {}
        for p in wanted:
            key = (p["path"], p["line"])
            if p["lang"] == "python":
                futures[key] = (python_done, folders[key])
            else:
                futures[key] = (pool.submit(_run_shell_block, p["code"], shims, folders[key]), None)
        yield {key: (lambda f=f, folder=folder: f.result()[folder] if folder else f.result())
               for key, (f, folder) in futures.items()}


@pytest.mark.parametrize("path,line,lang,code,reason", RUNNABLE, ids=["%s:%d" % (_rel(b[0]), b[1]) for b in RUNNABLE])
def test_block_runs_as_written(path, line, lang, code, reason, block_runs):
    error, output = block_runs[(path, line)]()
    assert error is None, "%s:%d failed: %s\n%s" % (_rel(path), line, error, output)
