"""The command line: every error class is one message with its exit code, never a traceback
(only --debug shows one); Ctrl-C exits 130; progress output; --version and python -m."""

import importlib.metadata
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fusegen import build, cli, output, progress
from fusegen.toolchain import nvrtc, ptxas

ROOT = Path(__file__).resolve().parents[2]
SPEC = "from fusegen.eager import Sequential, RMSNorm, GELU\nblock = Sequential(RMSNorm(64), GELU())\n"


def run(capsys, *args):
    code = cli.main(list(args))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.err


@pytest.fixture
def spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spec.py").write_text(SPEC)
    return "spec.py"


GENERATE = ("generate", "spec.py", "--out", "fused", "--archs", "sm_90", "--dtypes", "float32")


def test_malformed_pyproject(tmp_path, spec, capsys):
    (tmp_path / "pyproject.toml").write_text("[tool.fusegen\n")
    code, err = run(capsys, "generate")
    assert code == 2 and "pyproject.toml: not valid TOML" in err and err.count("\n") == 1


def test_unknown_config_key(tmp_path, spec, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.fusegen]\nspec = ["spec.py"]\n')
    code, err = run(capsys, "generate")
    assert code == 2 and "unknown key 'spec'; did you mean 'specs'?" in err


def test_arch_nvrtc_rejects_is_refused_before_compiling(spec, capsys):
    code, err = run(capsys, "generate", "spec.py", "--out", "fused", "--archs", "sm_70")
    assert code == 2 and "arch 'sm_70' is not supported by the pinned NVRTC" in err
    assert not Path("fused").exists()


def test_empty_archs_is_an_error_not_the_defaults(spec, capsys):
    code, err = run(capsys, "generate", "spec.py", "--out", "fused", "--archs", "")
    assert code == 2 and "--archs needs a comma-separated list" in err


def test_missing_spec_file_exits_2(tmp_path, spec, capsys):
    code, err = run(capsys, "generate", "nope.py", "--out", "fused")
    # one "fusegen: " (issue 36: "fusegen: error: fusegen: spec file ...")
    assert code == 2 and err == f"fusegen: error: spec file 'nope.py' not found (looked for {tmp_path / 'nope.py'})\n"


def test_a_folder_named_as_a_spec_is_one_message(tmp_path, spec, capsys):
    (tmp_path / "specs").mkdir()
    code, err = run(capsys, "plan", "specs")
    assert code == 2 and err == "fusegen: error: spec 'specs' is a folder; name the spec files or a glob like 'specs/*.py'\n"


def test_spec_error_has_its_location(tmp_path, spec, capsys):
    (tmp_path / "spec.py").write_text(SPEC.replace("RMSNorm(64)", "RMSNorm(-1)"))
    code, err = run(capsys, "plan", "spec.py")
    assert code == 2 and err.startswith("spec.py:2:28: error: ") and "^" in err


def test_out_naming_an_existing_file(tmp_path, spec, capsys):
    (tmp_path / "taken").write_text("")
    code, err = run(capsys, *GENERATE[:3], "taken")
    assert code == 2 and "output taken is a file, not a folder" in err


def test_missing_cuda_headers_is_a_toolchain_error(spec, capsys, monkeypatch):
    def no_headers(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(nvrtc.importlib.metadata, "distribution", no_headers)
    code, err = run(capsys, *GENERATE)
    assert code == 3 and "CUDA headers not found: install the pinned nvidia-cuda-runtime" in err
    assert not Path("fused").exists()


def test_a_missing_nvrtc_library_is_a_toolchain_error(spec, capsys, monkeypatch):
    class DynamicLibNotFoundError(RuntimeError):  # what cuda.pathfinder raises on the first call
        pass

    def not_found():
        raise DynamicLibNotFoundError("Failure finding \"libnvrtc.so.13\"")

    monkeypatch.setattr(nvrtc.nvrtc, "nvrtcGetSupportedArchs", not_found)
    code, err = run(capsys, *GENERATE)
    assert code == 3 and "cannot load the NVRTC library (DynamicLibNotFoundError: Failure finding" in err
    assert "pip install 'cuda-bindings==13.0.3' 'nvidia-cuda-nvrtc==13.0.88'" in err and "Traceback" not in err


def test_a_missing_ptxas_is_a_toolchain_error(spec, capsys, monkeypatch):
    """sm_120 is assembled from sm_100's PTX by the pinned ptxas (nvrtc.ASSEMBLED_FROM)."""
    real = importlib.metadata.distribution

    def without_nvcc(name):
        if name == ptxas.PACKAGE:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_nvcc)
    ptxas.executable.cache_clear()
    try:
        code, err = run(capsys, "generate", "spec.py", "--out", "fused", "--archs", "sm_100,sm_120",
                        "--dtypes", "float32")
    finally:
        ptxas.executable.cache_clear()
    assert code == 3 and "ptxas not found: install the pinned nvidia-cuda-nvcc package" in err
    assert "pip install 'nvidia-cuda-nvcc==13.0.88'" in err and not Path("fused").exists()


def test_nvrtc_compile_failure_is_a_toolchain_error(spec, capsys, monkeypatch):
    real = build.cuda_source
    monkeypatch.setattr(build, "cuda_source", lambda *a: real(*a) + "\nthis is not C++;\n")
    code, err = run(capsys, *GENERATE)
    assert code == 3 and "NVRTC failed for sm_90" in err and "error" in err
    assert not Path("fused").exists()


def test_file_system_errors_are_messages(spec, capsys, monkeypatch):
    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(output, "_write_atomic", refuse)
    code, err = run(capsys, *GENERATE)
    assert code == 2 and "fusegen: error: [Errno 13] Permission denied" in err


def test_an_internal_error_is_one_message_and_debug_shows_the_traceback(spec, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("bug")

    monkeypatch.setattr(build, "plan_documents", broken)
    code, err = run(capsys, "plan", "spec.py")
    assert code == 70 and "internal error: ValueError: bug" in err and "--debug" in err
    assert cli.main(["plan", "spec.py", "--debug"]) == 70
    assert "Traceback" in capsys.readouterr().err


def test_stale_message_names_the_config_it_used(tmp_path, spec, capsys):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.fusegen]\nspecs = ["spec.py"]\npackage = "fused"\narchs = ["sm_90"]\ndtypes = ["float32"]\n')
    assert run(capsys, "generate", "--check")[0] == 1
    code, err = run(capsys, "generate", "--check")
    assert code == 1 and "run `fusegen generate` (it reads [tool.fusegen] of pyproject.toml)" in err
    assert "make" not in err


def test_plain_progress_in_a_log(spec, capsys):
    code, err = run(capsys, *GENERATE)
    assert code == 0
    assert "fusegen: compiling 5 kernel binaries in 5 compiles with NVRTC 13.0 (0 reused)" in err
    assert "  [5/5] compiled" in err and "fusegen: fused: " in err


def test_progress_counts_one_binary_as_one(spec, capsys):
    assert run(capsys, *GENERATE)[0] == 0
    Path("fused/kernels/gelu_fwd_n64.sm_90.cubin").unlink()
    code, err = run(capsys, *GENERATE)
    assert code == 0
    assert "fusegen: compiling 1 kernel binary in 1 compile with NVRTC 13.0 (4 reused)\n" in err
    # 45: the runtime's 19 modules (compiled_passes.py, torch.compile's training ops, the tenth;
    # te_forms.py, TE's attention call forms; row_blocks.py, TE's split and interleaved QKV
    # parameters; fp8_recipes.py, fp8_autocast.py, fp8_state.py, fp8_casts.py and fp8.py, FP8;
    # collectives.py and tensor_parallel.py, tensor parallelism)
    # and the kernel headers every package ships (attention_prep.cuh, attention_prep_table.cuh,
    # quantize.cuh, quantize_blocks.cuh, amax.cuh and fp8_tile.cuh among them)
    assert "fusegen: fused: 45 files, 1 written, 0 removed\n" in err


def test_plain_progress_names_a_slow_kernel(monkeypatch):
    stream = io.StringIO()
    report = progress.PlainProgress(stream)
    report.start(3, "compiling 3 kernel binaries")
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    report.update(0, ["rmsnorm_fwd_h65536.sm_90"])
    report.update(3, [])
    assert stream.getvalue().splitlines() == [
        "fusegen: compiling 3 kernel binaries",
        "  [0/3] still compiling rmsnorm_fwd_h65536.sm_90",
        "  [3/3] compiled",
    ]


def test_live_progress_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    report = progress.for_stream(stream)
    assert isinstance(report, progress.LiveProgress)
    report.start(10, "compiling 10 kernel binaries")
    assert report.bar.live.auto_refresh and report.bar.live.refresh_per_second >= 1  # redrawn every second
    report.update(3, ["gelu_fwd_n64.sm_90"])
    report.finish()
    text = stream.getvalue()
    assert "3/10" in text and "gelu_fwd_n64.sm_90" in text
    assert isinstance(progress.for_stream(io.StringIO()), progress.PlainProgress)


def subprocess_env():
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _reader_gone(tmp_path, *args, closed="stdout"):
    """fusegen with its stdout (or stderr) a pipe whose reader has already left, as in
    `fusegen plan | head -1` once head has its line: (exit code, what the other stream got)."""
    read, write = os.pipe()
    os.close(read)
    streams = {"stdout": write, "stderr": subprocess.PIPE} if closed == "stdout" else \
        {"stdout": subprocess.PIPE, "stderr": write}
    try:
        result = subprocess.run([sys.executable, "-m", "fusegen", *args], cwd=tmp_path, env=subprocess_env(),
                                text=True, timeout=300, **streams)
    finally:
        os.close(write)
    return result.returncode, result.stderr if closed == "stdout" else result.stdout


def test_a_reader_that_leaves_ends_the_output_not_the_command(tmp_path):
    (tmp_path / "spec.py").write_text(SPEC)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.fusegen]\nspecs = ["spec.py"]\npackage = "fused"\narchs = ["sm_90"]\ndtypes = ["float32"]\n')
    # progress and the summary on a stderr nobody reads: the package is written all the same
    assert _reader_gone(tmp_path, "generate", closed="stderr") == (0, "")
    check = subprocess.run([sys.executable, "-m", "fusegen", "generate", "--check"], cwd=tmp_path,
                           env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "fused is up to date" in check.stderr, check.stderr
    # --check's diff on a stdout nobody reads: still exit 1 for stale, its summary on stderr
    (tmp_path / "fused" / "block.py").write_text("# edited\n")
    code, err = _reader_gone(tmp_path, "generate", "--check")
    assert code == 1 and "fusegen: fused is stale: 1 text file differs" in err, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err
    # the commands that only print: exit 0, nothing on stderr
    for args in (("plan",), ("explain", "rmsnorm_fwd_h64"), ("ops",)):
        assert _reader_gone(tmp_path, *args) == (0, ""), args


def test_version_and_python_m(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fusegen", "--version"], capture_output=True, text=True,
                            env=subprocess_env(), cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"fusegen {cli.version()}"
    (tmp_path / "spec.py").write_text(SPEC.replace("GELU()", "GELU(3)"))
    result = subprocess.run([sys.executable, "-m", "fusegen", "plan", "spec.py"], capture_output=True, text=True,
                            env=subprocess_env(), cwd=tmp_path)
    assert result.returncode == 2 and "spec.py:2:" in result.stderr and "Traceback" not in result.stderr


# The two entry points as an installation runs them: the console script pyproject.toml names (the
# wrapper pip writes calls it, as here) and `python -m fusegen`.
ENTRY_POINTS = {
    "console-script": ["-c", "import sys; from importlib.metadata import entry_points; "
                             "(script,) = entry_points(group='console_scripts', name='fusegen'); sys.exit(script.load()())"],
    "python-m": ["-m", "fusegen"],
}
# Makes the modules named in $UNIMPORTABLE fail to import, as in a wheel that left them out: None
# in sys.modules, and `import` raises ModuleNotFoundError. Python runs a sitecustomize on its path
# at start-up, before the command.
UNIMPORTABLE = "import os, sys\nfor name in os.environ['UNIMPORTABLE'].split(','):\n    sys.modules[name] = None\n"


def run_broken(tmp_path, entry_point, unimportable, *args):
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(UNIMPORTABLE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), str(ROOT)]), UNIMPORTABLE=unimportable)
    return subprocess.run([sys.executable, *ENTRY_POINTS[entry_point], *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


# fusegen.stages: what the wheels left out (imported with the commands); fusegen.errors and
# fusegen.commands: what the handler's own module needs; fusegen.toolchain.nvrtc: imported by `generate` once
# it runs.
@pytest.mark.parametrize("module", ["fusegen.stages", "fusegen.errors", "fusegen.commands", "fusegen.toolchain.nvrtc"])
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_a_broken_installation_exits_70_with_one_line(tmp_path, entry_point, module):
    (tmp_path / "spec.py").write_text(SPEC)
    result = run_broken(tmp_path, entry_point, module, *GENERATE)
    assert result.returncode == 70, result.stderr
    assert result.stderr.splitlines() == [
        f"fusegen: internal error: fusegen is installed incompletely: cannot import {module} (ModuleNotFoundError: "
        f"import of {module} halted; None in sys.modules); reinstall fusegen, and if that does not help, report "
        "it with the output of --debug"], result.stderr
    assert result.stdout == "" and not (tmp_path / "fused").exists()


def test_a_broken_installation_answers_version_and_debug_shows_the_traceback(tmp_path):
    (tmp_path / "spec.py").write_text(SPEC)
    result = run_broken(tmp_path, "python-m", "fusegen.stages", "plan", "spec.py", "--debug")
    assert result.returncode == 70 and result.stderr.startswith("Traceback"), result.stderr
    assert result.stderr.splitlines()[-1].startswith("fusegen: internal error: fusegen is installed incompletely")
    result = run_broken(tmp_path, "console-script", "fusegen.stages", "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"fusegen {cli.version()}", result.stderr
    result = run_broken(tmp_path, "console-script", "jinja2", "plan", "spec.py")
    assert result.returncode == 70 and result.stderr.startswith(
        "fusegen: internal error: a dependency of fusegen is missing or broken: cannot import jinja2 "
        "(ModuleNotFoundError: "), result.stderr


# An exception fusegen did not expect, raised in the middle of a command of the program: exit 70,
# never 1 (--check's "stale"), SystemExit(1) from code that should not exit included.
@pytest.mark.parametrize("raised, message", [
    ("ValueError('bug')", "fusegen: internal error: ValueError: bug (a bug in fusegen: please report it with "
                          "the output of --debug)"),
    ("SystemExit(1)", "fusegen: internal error: SystemExit: 1 (a bug in fusegen: please report it with the "
                      "output of --debug)"),
])
def test_an_internal_error_mid_command_exits_70(tmp_path, raised, message):
    (tmp_path / "spec.py").write_text(SPEC)
    program = (f"import sys, fusegen.build\ndef broken(*args, **kwargs):\n    raise {raised}\n"
               "fusegen.build.plan_documents = broken\nfrom fusegen.cli import main\nsys.exit(main())\n")
    result = subprocess.run([sys.executable, "-c", program, "plan", "spec.py"], cwd=tmp_path,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 70 and result.stderr.splitlines() == [message], result.stderr


CTRL_C_SPEC = """\
from fusegen.eager import Sequential, RMSNorm, LayerNorm, GELU, SiLU, ReLU, SwiGLU, Bias
a = Sequential(RMSNorm(4096), GELU(), Bias(4096), SiLU())
b = Sequential(LayerNorm(2048), ReLU(), SwiGLU(), Bias(1024))
c = Sequential(RMSNorm(1024), SiLU(), Bias(1024), GELU())
d = Sequential(LayerNorm(512), GELU(), Bias(512), ReLU())
e = Sequential(RMSNorm(768), SwiGLU(), Bias(384), SiLU())
"""


def live_processes_of_group(group: int) -> dict[int, str]:
    """{pid: command line} of the processes of a process group still running (Linux's /proc;
    zombies left out: they have exited, only their parent has not collected them)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after "pid (comm)": state ppid pgrp
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited while we looked
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found[int(stat.parent.name)] = command
    return found


# The spec's 50 compiles run in worker processes with the threshold below them, on threads of
# fusegen's own process with it above. A Ctrl-C 0.2 s after the first line reaches worker processes
# still importing the compiler (0.7 s), which printed their own tracebacks before they started with
# SIGINT blocked (toolchain.jobs._sigint_blocked). The first Ctrl-C lets the compiles in flight finish; a
# second, 0.3 s later, lands while the pool waits for them (it hung there for good, in all of 6
# tries, before toolchain.jobs._CtrlC), and three 0.05 s apart also reach fusegen as it shuts the pool down
# and exits (a third printed a traceback and left the workers running).
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="lists a process group's processes from /proc")
@pytest.mark.parametrize("threaded_compiles, delay, presses, gap", [
    (0, 1.0, 1, 0), (10**6, 1.0, 1, 0), (0, 0.2, 1, 0), (0, 1.0, 2, 0.3), (0, 1.0, 3, 0.05), (0, 0.2, 3, 0.05),
    (10**6, 1.0, 3, 0.05)],
    ids=["processes", "threads", "processes-while-starting", "processes-twice", "processes-three-times",
         "processes-while-starting-three-times", "threads-three-times"])
def test_ctrl_c_during_compilation_exits_130_with_one_line(tmp_path, threaded_compiles, delay, presses, gap):
    (tmp_path / "spec.py").write_text(CTRL_C_SPEC)
    # fusegen's main, as the console script runs it, with Python's own Ctrl-C handler: a shell's
    # background job (`make test &`) inherits SIGINT ignored, and Python then installs none.
    threshold = f"import fusegen.toolchain.jobs as jobs; jobs.THREADED_COMPILES = {threaded_compiles}; "
    command = [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               f"{threshold}from fusegen.cli import main; sys.exit(main())", "generate", "spec.py", "--out", "fused"]
    # A new session, signalled as a group: like a terminal's Ctrl-C, it reaches the workers too.
    proc = subprocess.Popen(command, cwd=tmp_path, env=subprocess_env(), stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        first = proc.stderr.readline()
        assert "fusegen: compiling 125 kernel binaries in 50 compiles" in first, first
        time.sleep(delay)
        started = live_processes_of_group(proc.pid)
        pressed = []
        for _ in range(presses):
            if pressed:
                time.sleep(gap)
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:  # every process of the group has exited: nothing to press
                break
            pressed.append(time.monotonic())
        rest = proc.communicate(timeout=60)[1]  # not read(): a hung fusegen would keep stderr open
        exited = time.monotonic()
        assert proc.returncode == 130
    finally:
        if proc.poll() is None:  # a hang: leave no process behind, then fail
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    lines = [line for line in rest.splitlines() if not line.startswith("  [")]  # progress lines may precede it
    assert lines == ["fusegen: interrupted (every file is written whole or not at all)"]
    assert not list(tmp_path.rglob("*.tmp"))
    workers = {pid for pid, command in started.items() if "multiprocessing.spawn" in command}
    assert bool(workers) == (threaded_compiles == 0), started
    if presses > 1:  # a second Ctrl-C kills the workers: an exit in a fraction of a second (2 s for a busy CI machine)
        assert exited - pressed[1] < 2.0, exited - pressed[1]
    # nothing of the run is left: not its workers, nor a ptxas one ran, nor multiprocessing's
    # resource tracker (which ends once fusegen has)
    deadline = time.monotonic() + 5
    while live_processes_of_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live_processes_of_group(proc.pid)


@pytest.mark.parametrize("body, message", [
    ("_kernels = Sequential(GELU(), RMSNorm(8))", "pipeline name '_kernels' is taken by the generated package itself"),
    ("mlp_block = Sequential(RMSNorm(8))\nmlp__block = Sequential(RMSNorm(8))", "gives the class name MlpBlock"),
    ("mlp = Sequential(RMSNorm(8))\nMlp = Sequential(RMSNorm(8))", "one file on case-insensitive file systems"),
    ("slow = Sequential(RMSNorm(10**6))", "must be at most 65536 (2**16), got 1000000"),
    ("bad = Sequential(RMSNorm(8, eps=1e999))", "number too large"),
    ("A = (H := 16)\nm = Sequential(RMSNorm(H))", "write H = 16 on a line of its own"),
    ("if True:\n    m = Sequential(RMSNorm(8))", "a pipeline must be defined at module level"),
    ("m = Sequential(RMSNorm(8))\nx = " + "[" * 200 + "]" * 200, "nested too deeply"),
])
def test_spec_mistakes_from_the_issue_are_located_messages(tmp_path, spec, capsys, body, message):
    (tmp_path / "spec.py").write_text("from fusegen.eager import Sequential, RMSNorm, GELU\n" + body + "\n")
    code, err = run(capsys, *GENERATE)
    assert code == 2 and err.startswith("spec.py:") and message in err, err
    assert not Path("fused").exists()


def test_an_op_no_rule_covers_is_a_located_message(spec, capsys, monkeypatch):
    from fusegen import fusion_rules

    without = tuple(r for r in fusion_rules.FORWARD_RULES if r.name != "elementwise")
    monkeypatch.setattr(fusion_rules, "FORWARD_RULES", without)
    code, err = run(capsys, "plan", "spec.py")
    assert code == 2 and err.startswith("spec.py:2:33: error: no forward fusion rule covers op 1, GELU()"), err


def test_ops_lists_every_registered_op_with_its_signature(capsys):
    from fusegen.ops import OPS

    assert cli.main(["ops"]) == 0
    out = capsys.readouterr().out
    for op in OPS.values():
        listed = f"{op.signature()}\n    {op.summary}  (from {' or '.join(op.modules)})" in out
        assert listed == bool(op.modules), op.name  # internal basic ops (no modules) are not listed
    assert "RowScale" not in out and "ScaledSwiGLU(glu_interleave_size=None, *, " in out
    assert "nn.Linear(in_features, out_features, bias=True, *, device=None, dtype=None)\n" in out
    assert out.endswith("Residual(*ops)\n    y = x + ops(x): a container of ops, nestable  (from "
                        "transformer_engine.pytorch.ops or transformer_engine.pytorch or fusegen.eager)\n")
