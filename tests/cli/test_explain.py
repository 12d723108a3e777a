"""`fusegen explain KERNEL`: a kernel's specialisation, NVRTC options, each binary with its size and
the registers and stack frame its cubin records, and its source; a clear error for a name the
package does not have."""

import json
import re
from pathlib import Path

import pytest

from fusegen import cli
from fusegen.explain import resources

ROOT = Path(__file__).resolve().parents[2]


def test_explain_a_shipped_kernel(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["explain", "layernorm_fwd_h4096_bf16"]) == 0  # a dtype suffix is optional
    out = capsys.readouterr().out
    assert out.startswith("kernel layernorm_fwd_h4096: LayerNorm(4096)\n")
    assert "NVRTC 13.0: --gpu-architecture=<arch> --std=c++17" in out
    assert ("\nptxas 13.0.88: sm_90 assembled from the PTX of the sm_80 compile (-arch=sm_90)\n"
            "ptxas 13.0.88: sm_120 assembled from the PTX of the sm_100 compile (-arch=sm_120)\n") in out
    binaries = re.findall(r"^layernorm_fwd_h4096\.(sm_\d+\.cubin|compute_\d+\.ptx) +(\d+)$", out, re.M)
    # every arch of the package (sm_80, sm_90, sm_100, sm_120, compute_80), cubins by number, then PTX
    assert [b for b, _ in binaries] == ["sm_80.cubin", "sm_90.cubin", "sm_100.cubin", "sm_120.cubin", "compute_80.ptx"]
    for binary, size in binaries:
        assert int(size) == (ROOT / "generated" / "kernels" / f"layernorm_fwd_h4096.{binary}").stat().st_size
    # under each binary, its functions: every dtype's kernel, and fp32's few-rows entry point
    # (LayerNorm(4096) in fp32 does not hold gamma and beta: stages/norm/tuning.py: norm_fwd_few_rows)
    functions = re.findall(r"^  (layernorm_fwd_h4096_\w+) +(\S+) +(\S+(?: B)?)$", out, re.M)
    names = [f"layernorm_fwd_h4096_{entry}" for entry in ("bf16", "fp16", "fp32", "fp32_few_rows")]
    assert [name for name, _, _ in functions] == names * 5
    for index, (name, registers, frame) in enumerate(functions):
        if index < 4 * len(names):  # a cubin's
            assert 1 <= int(registers) <= 255 and frame.endswith(" B"), name
        else:  # the PTX is compiled by the driver: neither is known
            assert registers == "-" and frame == "-"
    assert "--- generated/kernels/layernorm_fwd_h4096.cu ---\n// layernorm_fwd_h4096: LayerNorm(4096)" in out


def test_every_shipped_cubin_records_each_functions_registers_and_stack_frame():
    manifest = json.loads((ROOT / "generated" / "MANIFEST.json").read_text())["kernels"]
    cubins = sorted((ROOT / "generated" / "kernels").glob("*.cubin"))
    assert cubins
    for cubin in cubins:
        found = resources(cubin.read_bytes())
        functions = [f for entries in manifest[cubin.name.split(".")[0]]["entries"].values() for f in entries]
        # the kernel's entry points, and subroutines kept out of line, named with a "$" (an fp32
        # division's slow path: $__internal_..._div_rn_noftz_f32_slowpath; a __noinline__ function,
        # $<entry>$<its mangled name>: quantize_blocks.cuh's fp8_byte below sm_89)
        assert set(functions) <= set(found), cubin.name
        assert all(f.startswith("$") for f in set(found) - set(functions)), (cubin.name, sorted(found))
        for function in functions:
            assert 1 <= found[function]["registers"] <= 255 and found[function]["stack_frame"] >= 0, (cubin.name, function)
        for function in set(found) - set(functions):  # runs on its caller's registers: records its stack only
            assert found[function] == {"stack_frame": found[function]["stack_frame"]}, (cubin.name, function)


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
