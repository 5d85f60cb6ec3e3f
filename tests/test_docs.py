"""The docs match their data and their code: every measured figure in README.md, PERFORMANCE.md and
docs/ is rendered from benchmarks/results/*.json by benchmarks/tables.py (tables and figures between
markers, checked current here) and each results file records its run; every Python block runs as
written (on CPU: Triton's interpreter and the NKI emulator), every shell block names real make
targets, files and options, and every `[[variant]]` block is a valid spec entry.

A block whose first line is `# gpu-only ...` runs only where CUDA is available, `# trainium-only ...`
only where torch_neuronx imports; `# <file>.py: torchrun ...` is saved as <file>.py and run with
that command.
"""

import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import tables  # noqa: E402

DOCS = [ROOT / "README.md", ROOT / "PERFORMANCE.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
CUDA = torch.cuda.is_available()
NEURON = importlib.util.find_spec("torch_neuronx") is not None


def blocks(path, language):
    """(line, code) of each fenced block of `language` in path, dedented."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group("body")))
            for m in FENCE.finditer(text) if m.group("info").strip() == language]


def prose(path):
    """path's text without its fenced blocks and without what the markers render."""
    text = FENCE.sub("", path.read_text())
    text = tables.MARKED.sub("", text)
    return tables.FIGURE.sub("", text)


def doc_id(path):
    return str(path.relative_to(ROOT))


# --- figures ------------------------------------------------------------------------------------------

def test_tables_and_figures_are_rendered_from_the_results():
    """What `python3 benchmarks/tables.py` would write is what the docs hold, and every marker renders."""
    rendered = tables.render_all()
    problems = []
    for path in tables.FILES:
        _, changed, unknown = tables.rewrite(path.read_text(), rendered)
        problems += [f"{doc_id(path)}: {name} is stale (run python3 benchmarks/tables.py)" for name in changed]
        problems += [f"{doc_id(path)}: nothing renders {name!r}" for name in unknown]
    assert not problems, "\n".join(problems)


def test_rewrite_replaces_a_stale_figure_and_names_an_unknown_one():
    text = "at <!-- fig:a -->1.0x<!-- /fig --> and <!-- fig:b -->2x<!-- /fig -->\n<!-- table:t -->\nold\n<!-- /table:t -->\n"
    new, changed, unknown = tables.rewrite(text, {"a": "1.5x", "t": "| new |"})
    assert new == "at <!-- fig:a -->1.5x<!-- /fig --> and <!-- fig:b -->2x<!-- /fig -->\n<!-- table:t -->\n| new |\n<!-- /table:t -->\n"
    assert changed == ["t", "a"] and unknown == ["b"]


# A number with a unit of time, rate, ratio, share, size or quality, or a count of tests, outside
# rendered markers and code: a measurement no results file backs.
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
MEASURED = re.compile(rf"\b{NUMBER}(?:\s?(?:-|–|to)\s?{NUMBER})?"
                      r"(?:x\b|\s?%|\s?(?:ms|us|µs|GB/s|TB/s|dB|GiB|MiB|MB|GB)\b|\s(?:CPU-)?minutes?\b|\sseconds?\b"
                      r"|\s(?:tests|passed|failed)\b)")
# Figures in the docs that are not measurements.
NOT_MEASURED = {
    "45 GB/s",  # PERFORMANCE.md: the EP=64 estimate's assumed inter-node bandwidth per GPU
}


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_every_figure_in_prose_is_rendered(path):
    found = [m.group(0) for m in MEASURED.finditer(prose(path)) if m.group(0) not in NOT_MEASURED]
    assert not found, (f"{doc_id(path)}: measured figures outside the rendered markers {found}: render them from "
                       f"benchmarks/results/*.json (benchmarks/tables.py) or remove them")


def test_the_figure_check_sees_a_figure():
    text = "runs 1.01-1.07x, +18% at 5 ms; 2,033 tests; H=7168, k=2, us per call; 0xFF; 2 x (E x H)"
    assert [m.group(0) for m in MEASURED.finditer(text)] == ["1.01-1.07x", "18%", "5 ms", "2,033 tests"]


# --- provenance ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_results_file_records_its_run(path):
    run = json.loads(path.read_text())["run"]
    assert set(run) - {"from_git_history"} == set(tables.RUN_FIELDS), run
    assert set(run.get("from_git_history", ())) <= set(tables.RUN_FIELDS)
    assert run["date"] and run["commit"] and run["gpu"], run


def test_performance_md_shows_the_run_of_every_results_file():
    assert {path.name for path in RESULTS} == set(tables.RESULT_FILES)


def test_run_metadata_records_every_field():
    import triton

    run = tables.run_metadata(command="python3 benchmarks/bench.py")
    assert tuple(run) == tables.RUN_FIELDS
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", run["date"]), run["date"]
    assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", run["commit"]), run["commit"]
    assert (run["torch"], run["triton"]) == (torch.__version__, triton.__version__)
    assert run["gpu"] == (torch.cuda.get_device_name() if CUDA else "none")
    assert run["command"] == "python3 benchmarks/bench.py" and run["python"]


BENCHMARKS = sorted([*(ROOT / "benchmarks").glob("bench*.py"), *(ROOT / "benchmarks").glob("nki_*cost.py")])


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_scripts_record_their_run(path):
    """Every script that writes a results file records its run with tables.run_metadata."""
    source = path.read_text()
    assert ".json" in source
    assert "run_metadata(" in source and "from tables import" in source, (
        f"{path.name} writes results without tables.run_metadata()")


# --- code blocks --------------------------------------------------------------------------------------

RUNNER = r"""
import io, json, sys, traceback
from contextlib import redirect_stdout
report = []
for line, code in json.load(sys.stdin):
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            exec(compile(code, f"block at line {line}", "exec"), {"__name__": "__main__"})
        report.append((line, out.getvalue(), None))
    except BaseException:
        report.append((line, out.getvalue(), traceback.format_exc()))
print("\0" + json.dumps(report))
"""


def needs(code):
    """Why a block cannot run here, or None: its first line's mark, an optional package it imports
    that is not installed, or more GPUs than this machine has for its torchrun processes."""
    first = code.lstrip().splitlines()[0]
    if first.startswith("# gpu-only") and not CUDA:
        return "gpu-only"
    if first.startswith("# trainium-only") and not NEURON:
        return "trainium-only"
    for package in re.findall(r"^(?:from|import) (megatron|transformer_engine)\b", code, re.M):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed"
    ranks = re.search(r"--nproc-per-node[ =](\d+)", first)
    if CUDA and ranks and torch.cuda.device_count() < int(ranks.group(1)):
        return f"{ranks.group(1)} ranks of one GPU each; this machine has {torch.cuda.device_count()}"
    return None


def block_env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if not CUDA:
        env["TRITON_INTERPRET"] = "1"  # as the docs say for CPU tensors
    return env


def check_output(where, out):
    bad = [line for line in out.splitlines() if "ok:" in line and "False" in line]
    assert not bad, f"{where} printed a failed check: {bad}"


DOCS_WITH_PYTHON = [p for p in DOCS if blocks(p, "python")]


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launched_as(code):
    """(file, command) of a block to save and launch, from its first line `# <file>.py: <command>`."""
    found = re.match(r"# (\w+\.py): (.*)", code.lstrip().splitlines()[0])
    return found.groups() if found else None


@pytest.fixture(scope="module")
def block_reports(tmp_path_factory):
    """Every plain Python block of the docs, each in a fresh namespace, all in one process (torch and
    the kernels imported once): (path, line) -> (printed, traceback or None)."""
    plain = [(doc_id(path), line, code) for path in DOCS_WITH_PYTHON for line, code in blocks(path, "python")
             if not needs(code) and not launched_as(code)]
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps([(line, code) for _, line, code in plain]),
                          capture_output=True, text=True, cwd=tmp_path_factory.mktemp("blocks"), env=block_env(),
                          timeout=600)
    assert "\0" in done.stdout, done.stderr[-3000:]
    report = json.loads(done.stdout.rsplit("\0", 1)[1])
    return {(doc, line): (out, error) for (doc, line, _), (_, out, error) in zip(plain, report)}


PYTHON_BLOCKS = [(path, line, code) for path in DOCS_WITH_PYTHON for line, code in blocks(path, "python")]


@pytest.mark.parametrize("path, line, code", PYTHON_BLOCKS, ids=[f"{doc_id(p)}:{n}" for p, n, _ in PYTHON_BLOCKS])
def test_python_block_runs_as_written(path, line, code, block_reports, tmp_path):
    where = f"{doc_id(path)}: the block at line {line}"
    if needs(code):
        pytest.skip(f"{where}: {needs(code)}")
    if launched_as(code):
        name, command = launched_as(code)
        (tmp_path / name).write_text(code)
        argv = shlex.split(command)
        if argv[0] == "torchrun":  # on a free port: other runs may hold torchrun's default
            argv = [sys.executable, "-m", "torch.distributed.run", f"--master-port={free_port()}", *argv[1:]]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=block_env(), timeout=300)
        assert done.returncode == 0, f"{where} fails as written:\n{done.stderr[-3000:]}"
        out = done.stdout
    else:
        out, error = block_reports[doc_id(path), line]
        assert error is None, f"{where} fails as written:\n{error}"
    check_output(where, out)


def test_blocks_marked_for_other_hardware_say_so_on_their_first_line():
    """A block naming CUDA-only or Neuron-only things, with no CPU path, carries its mark."""
    for path in DOCS_WITH_PYTHON:
        for line, code in blocks(path, "python"):
            if "torch_neuronx" in code:
                assert needs(code) or NEURON, f"{doc_id(path)}:{line}: mark it '# trainium-only'"


MAKE_TARGETS = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
PATH = r"(?:benchmarks|tests|permgen|generator|templates|generated|docs)/[\w./-]*\w"
REPO_PATH = re.compile(rf"(?<![\w./-])({PATH})")


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p, "sh")], ids=doc_id)
def test_shell_blocks_name_real_targets_files_and_options(path):
    for line, code in blocks(path, "sh"):
        for command in code.splitlines():
            command = command.split("#", 1)[0]
            for target in re.findall(r"\bmake\s+([a-z][\w-]*)", command):
                assert target in MAKE_TARGETS, f"{doc_id(path)}:{line}: no make target {target!r}"
            for file in REPO_PATH.findall(command):
                assert (ROOT / file).exists(), f"{doc_id(path)}:{line}: no file {file}"
            script = re.search(r"(benchmarks/\w+\.py)((?:\s+--[\w-]+)+)", command)
            if script:
                for option in re.findall(r"--[\w-]+", script.group(2)):
                    assert option in (ROOT / script.group(1)).read_text(), f"{doc_id(path)}:{line}: no {option}"


def anchors(path):
    """The anchors GitHub gives path's headings."""
    headings = re.findall(r"^#+ (.*)$", FENCE.sub("", path.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_files_links_and_anchors_named_in_the_docs_exist(path):
    text = FENCE.sub("", path.read_text())
    missing = [f for f in re.findall(rf"`({PATH})/?`", text) if not (ROOT / f).exists()]
    links = re.sub(r"`[^`\n]*`", "", text)  # not what inline code shows, such as kernel[2](...)
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", links):
        linked = path.parent / target if target else path
        if target.startswith("http") or linked.suffix not in (".md", ""):
            continue
        if not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            missing.append(f"{target}#{anchor}")
    assert not missing, f"{doc_id(path)} names files or anchors that do not exist: {missing}"


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p, "toml")], ids=doc_id)
def test_variant_blocks_are_valid_spec_entries(path):
    from generator.spec import parse_spec

    defaults = tomllib.loads((ROOT / "variants.toml").read_text())["defaults"]
    header = "[defaults]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in defaults.items())
    text = path.read_text()
    for line, code in blocks(path, "toml"):
        (variant,) = parse_spec(header + code, f"{doc_id(path)}:{line}")
        assert variant.name in text, f"{doc_id(path)}:{line}: the text never names the variant {variant.name}"


# --- errors that tell the fix -------------------------------------------------------------------------

MEGATRON_INSTALL = 'pip install --no-deps "megatron-core==0.16.1" numpy packaging'


def test_megatron_enable_without_megatron_core_gives_the_install_command(monkeypatch):
    """The command is the README's, and installs the release the Makefile tests with."""
    from permgen.integrations import megatron

    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # megatron-core not installed
    with pytest.raises(ImportError) as missing:
        megatron.enable()
    assert MEGATRON_INSTALL in str(missing.value) and not megatron.enabled()
    assert MEGATRON_INSTALL in (ROOT / "README.md").read_text()
    assert '--no-deps "megatron-core==0.16.1"' in (ROOT / "Makefile").read_text()


def test_the_readme_states_the_torch_that_import_permgen_requires():
    import permgen

    assert f"torch {'.'.join(map(str, permgen.MIN_TORCH))} or newer" in (ROOT / "README.md").read_text()
