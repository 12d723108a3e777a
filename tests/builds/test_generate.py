"""The generate command: determinism, totality, the stale-output gate, and the output package
standing alone (imports without libcst and jinja2; state_dict compatible with the eager Sequential)."""

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fusegen import build, cli, output
from fusegen.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SMALL_SPEC = textwrap.dedent("""\
    from fusegen.eager import Sequential, RMSNorm, Linear, GELU, AddExtraInput, MakeExtraOutput
    block = Sequential(AddExtraInput(), MakeExtraOutput(), RMSNorm(64), Linear(64, 128), GELU())
""")


def small_config(tmp_path, out_name="out"):
    spec = tmp_path / "small.py"
    spec.write_text(SMALL_SPEC)
    return build.Config((spec,), tmp_path / out_name, archs=("sm_90",), dtypes=("float32",), root=tmp_path)


@pytest.mark.real_nvrtc  # two real compiles of each kernel, not one and the memo
def test_two_builds_give_identical_bytes(tmp_path):
    first = build.build_package(small_config(tmp_path, "a"))
    second = build.build_package(small_config(tmp_path, "b"))
    assert first == second
    assert "kernels/add_rmsnorm_fwd_h64.sm_90.cubin" in first
    for rel, data in first.items():
        if not rel.endswith(".cubin"):
            text = data.decode()
            assert str(tmp_path) not in text and str(ROOT) not in text, f"{rel} holds an absolute path"


def test_generate_is_total_and_check_names_stale_files(tmp_path, capsys):
    config = small_config(tmp_path)
    files = build.build_package(config)
    assert output.write_package(files, config.out)[1] == []
    (config.out / "notes.txt").write_text("the user's own file\n")
    assert output.write_package(files, config.out) == ([], [])  # nothing differs: nothing is touched

    args = ["generate", str(tmp_path / "small.py"), "--out", str(config.out), "--archs", "sm_90", "--dtypes", "float32"]
    assert cli.main(args + ["--check"]) == 0
    (config.out / "block.py").write_text("# edited by hand\n")
    (config.out / "kernels" / "gelu_fwd_n128.cu").unlink()
    assert cli.main(args + ["--check"]) == 1
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    # a unified diff of each stale text file on stdout: the hand edit undone, the missing file whole
    label = str(config.out).lstrip("/")
    assert f"--- a/{label}/block.py\n+++ b/{label}/block.py\n" in out
    assert "\n-# edited by hand\n" in out and '\n+"""Pipeline `block` from ' in out
    assert f"--- /dev/null\n+++ b/{label}/kernels/gelu_fwd_n128.cu\n" in out
    assert "notes.txt" not in out + err
    # one summary line on stderr
    assert "is stale: 2 text files differ (+" in err and "0 binaries, 0 to remove" in err
    assert f"run `fusegen generate {tmp_path / 'small.py'} --out {config.out}" in err
    assert cli.main(args) == 0
    assert cli.main(args + ["--check"]) == 0

    # Dropping GELU from the spec: its kernel files, which the manifest lists, go; the user's file stays.
    (tmp_path / "small.py").write_text(SMALL_SPEC.replace(", GELU())", ")"))
    assert cli.main(args + ["--check"]) == 1
    captured = capsys.readouterr()
    assert f"remove {config.out}/kernels/gelu_fwd_n128.sm_90.cubin (fusegen no longer makes it)" in captured.out
    assert ", 4 to remove; run `fusegen generate" in captured.err  # GELU's forward and backward kernels: a .cu and a cubin each
    assert cli.main(args) == 0
    assert not list(config.out.glob("kernels/gelu_*"))
    assert (config.out / "notes.txt").read_text() == "the user's own file\n"
    assert cli.main(args + ["--check"]) == 0


def test_check_on_the_shipped_package():
    """The checked-in generated/ equals what the specs, rules and templates produce."""
    config = load_config([], None, None, None, None, supported_archs=None, cwd=ROOT)
    files = build.build_package(config)
    assert output.stale_files(files, ROOT / "generated") == []


def test_spec_error_is_reported_with_location(tmp_path, capsys):
    spec = tmp_path / "bad.py"
    spec.write_text("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.Linear(64, 32), te.ops.Linear(64, 8))\n")
    assert cli.main(["plan", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "bad.py:2:" in err and "expects 64 input features" in err and "^" in err


def test_package_imports_without_libcst_and_jinja2():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("libcst", "jinja2", "fusegen", "generator", "fusion_rules"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import torch, generated
        m = generated.Gpt2Mlp()
        y = m(torch.randn(2, 1024))
        y.sum().backward()
        print("ok", tuple(y.shape))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "ok (2, 1024)" in result.stdout


@pytest.mark.parametrize("file, name, cls", [
    pytest.param(file, name, cls, id=name) for file, name, cls in [
        ("te_mlp.py", "te_mlp", "TeMlp"), ("prenorm_block.py", "prenorm_block", "PrenormBlock"),
        ("gpt2_mlp.py", "gpt2_mlp", "Gpt2Mlp"), ("residual_split.py", "fc1", "Fc1"),
        ("residual_split.py", "fc2", "Fc2")]])
def test_state_dict_round_trip_with_eager_sequential(file, name, cls):
    import generated
    from fusegen import eager
    from fusegen.frontend import parse_spec_file

    spec = next(s for s in parse_spec_file(ROOT / "specs" / file) if s.name == name)
    torch.manual_seed(0)
    seq = eager.Sequential(*[getattr(eager, c.op)(**c.args) for c in spec.calls])
    torch.manual_seed(0)
    gen = getattr(generated, cls)()
    assert list(seq.state_dict()) == list(gen.state_dict()), name
    for (k, a), b in zip(seq.state_dict().items(), gen.state_dict().values()):
        assert a.shape == b.shape and torch.equal(a, b), f"{name}: {k} differs after the same seeded init"
    with torch.no_grad():
        for p in seq.parameters():
            p.normal_(0.0, 0.1)  # in place: no parameter-sized temporaries (TeMlp: 117M elements)
    gen.load_state_dict(seq.state_dict())
    x = torch.randn(3, gen.in_features)
    extra = [torch.randn(3, gen.out_features)] * (1 if name in ("fc2", "prenorm_block") else 0)
    want, got = seq(x, *extra), gen(x, *extra)
    want, got = (want if isinstance(want, tuple) else (want,)), (got if isinstance(got, tuple) else (got,))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def test_check_shows_binaries_by_hash_and_cuts_long_diffs(tmp_path, capsys):
    config = small_config(tmp_path)
    output.write_package(build.build_package(config), config.out)
    args = ["generate", str(tmp_path / "small.py"), "--out", str(config.out), "--archs", "sm_90", "--dtypes", "float32"]
    cubin = config.out / "kernels" / "gelu_fwd_n128.sm_90.cubin"
    cubin.write_bytes(b"damaged")
    lines = (config.out / "block.py").read_text().splitlines()
    (config.out / "block.py").write_text("\n".join(f"# {i}" for i in range(200)) + "\n")  # a long diff
    assert cli.main(args + ["--check"]) == 1
    captured = capsys.readouterr()
    sha = hashlib.sha256(b"damaged").hexdigest()[:12]
    assert f"binary {config.out}/kernels/gelu_fwd_n128.sm_90.cubin: sha256 {sha} -> sha256 " in captured.out
    assert f"more lines of {config.out}/block.py left out" in captured.out
    assert len(captured.out.splitlines()) < 80
    assert "1 text file differs (+" in captured.err
    assert f"(+{len(lines)} -200 lines)" in captured.err and "1 binary, 0 to remove" in captured.err
