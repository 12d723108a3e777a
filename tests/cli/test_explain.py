"""`fusegen explain KERNEL`: a kernel's specialisation, NVRTC options, each binary with its size and
the registers and stack frame its cubin records, and its source; a clear error for a name the
package does not have."""

import re
from pathlib import Path

import pytest

from fusegen import cli
from fusegen.explain import resources

ROOT = Path(__file__).resolve().parents[2]


def test_explain_a_shipped_kernel(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["explain", "rmsnorm_fwd_h4096_bf16"]) == 0  # a dtype suffix is optional
    out = capsys.readouterr().out
    assert out.startswith("kernel rmsnorm_fwd_h4096: RMSNorm(4096)\n")
    assert "NVRTC 13.0: --gpu-architecture=<arch> --std=c++17" in out
    rows = re.findall(r"^rmsnorm_fwd_h4096_(bf16|fp16|fp32)\.(sm_\d+\.cubin|compute_\d+\.ptx) +(\d+) +(\S+) +(\S+(?: B)?)$",
                      out, re.M)
    assert len(rows) == 3 * 5  # every dtype, every arch of the package (sm_80, sm_90, sm_100, sm_120, compute_80)
    for dtype, binary, size, registers, frame in rows:
        assert int(size) == (ROOT / "generated" / "kernels" / f"rmsnorm_fwd_h4096_{dtype}.{binary}").stat().st_size
        if binary.endswith(".cubin"):
            assert 1 <= int(registers) <= 255 and frame.endswith(" B")
        else:
            assert registers == "-" and frame == "-"
    assert "--- generated/kernels/rmsnorm_fwd_h4096_bf16.cu ---\n// rmsnorm_fwd_h4096_bf16: RMSNorm(4096)" in out


def test_every_shipped_cubin_records_its_registers_and_stack_frame():
    cubins = sorted((ROOT / "generated" / "kernels").glob("*.cubin"))
    assert cubins
    for cubin in cubins:
        found = resources(cubin.read_bytes())
        assert 1 <= found["registers"] <= 255 and found["stack_frame"] >= 0, cubin.name


@pytest.mark.parametrize("name, message", [
    ("rmsnorm_fwd_h409", "has no kernel named 'rmsnorm_fwd_h409'; did you mean rmsnorm_fwd_h4096"),
    ("nothing_like_it", "has no kernel named 'nothing_like_it'; it has "),
])
def test_an_unknown_kernel_is_a_clear_error(name, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["explain", name]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_package_not_generated_yet_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.fusegen]\nspecs = ["s.py"]\npackage = "fused"\n')
    (tmp_path / "s.py").write_text("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.GELU())\n")
    assert cli.main(["explain", "rmsnorm_fwd_h4096"]) == 2
    assert "fused holds no MANIFEST.json: generate the package first" in capsys.readouterr().err
