"""Compile-check the norm, column-sum and activation kernels with NVRTC (no GPU needed).

Renders templates/norm_fwd.cu.j2, norm_bwd.cu.j2 and column_sum.cu.j2 for every dtype over a
grid of shapes and flags, plus a tiny kernel that uses every struct in activations.cuh, and
compiles each for sm_90 (cubin, with ptxas -v so registers and spills can be reported). A few
sources are also compiled for sm_80 and compute_80 (PTX). Any warning counts as a failure.

    .venv/bin/python bench/compile_check.py [--jobs N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import jinja2
from cuda.bindings import nvrtc

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "templates"
CUDA_HEADERS = TEMPLATES / "cuda"

DTYPES = {"fp32": ("float", 4), "fp16": ("__half", 2), "bf16": ("__nv_bfloat16", 2)}
HIDDEN = (1024, 4096, 768, 4104)
NORM_MAX_THREADS = 512  # same rule as generator/kernels.py: norm_threads


def cuda_include_dir() -> Path:
    import nvidia

    for base in nvidia.__path__:
        include = Path(base) / "cu13" / "include"
        if (include / "cuda_bf16.h").is_file():
            return include
    sys.exit("cuda_bf16.h not found under nvidia/cu13/include (install nvidia-cuda-runtime)")


def vec_for(hidden: int, itemsize: int) -> int:
    """Widest power-of-two vector of at most 16 bytes that divides the row."""
    v = 16 // itemsize
    while hidden % v:
        v //= 2
    return v


def norm_threads(hidden: int, vec: int) -> int:
    return min(NORM_MAX_THREADS, -(-hidden // vec // 32) * 32)


ACTIVATIONS_SOURCE = """\
#include "common.cuh"
#include "activations.cuh"

// Uses every activation struct once, forward and backward.
template <typename T>
__device__ void all_activations(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float a = fg::to_float<T>(x[i]), b = fg::to_float<T>(x[n + i]), g = fg::to_float<T>(dy[i]);
  float da, db, acc = 0.f;
  acc += fg::Gelu::fwd(a) + fg::Gelu::bwd(a, g);
  acc += fg::Relu::fwd(a) + fg::Relu::bwd(a, g);
  acc += fg::Silu::fwd(a) + fg::Silu::bwd(a, g);
  acc += fg::SwiGLU::fwd(a, b);
  fg::SwiGLU::bwd(a, b, g, da, db);
  acc += da + db;
  acc += fg::GeGLU::fwd(a, b);
  fg::GeGLU::bwd(a, b, g, da, db);
  acc += da + db;
  out[i] = fg::from_float<T>(acc);
}

extern "C" __global__ void act_fp32(const float* __restrict__ x, const float* __restrict__ dy, float* __restrict__ out, int n) { all_activations<float>(x, dy, out, n); }
extern "C" __global__ void act_fp16(const __half* __restrict__ x, const __half* __restrict__ dy, __half* __restrict__ out, int n) { all_activations<__half>(x, dy, out, n); }
extern "C" __global__ void act_bf16(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ dy, __nv_bfloat16* __restrict__ out, int n) { all_activations<__nv_bfloat16>(x, dy, out, n); }
"""


def sources() -> dict[str, str]:
    """{kernel symbol: CUDA source} for every combination checked."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    out = {"activations_all": ACTIVATIONS_SOURCE}
    for suffix, (ctype, itemsize) in DTYPES.items():
        for hidden, layernorm, flag, zc in itertools.product(HIDDEN, (True, False), (False, True), (False, True)):
            vec = vec_for(hidden, itemsize)
            tag = ("layernorm" if layernorm else "rmsnorm") + ("_zc" if zc else "")
            common = dict(ctype=ctype, hidden=hidden, vec=vec, threads=norm_threads(hidden, vec),
                          layernorm=layernorm, zero_centered_gamma=zc)
            name = ("add_" if flag else "") + f"{tag}_fwd_h{hidden}_{suffix}"
            out[name] = env.get_template("norm_fwd.cu.j2").render(
                kernel_name=name, residual=flag, eps="1e-05f",
                header_comment=f"// {name}: compile check\n// (bench/compile_check.py)", **common)
            name = f"{tag}_bwd_h{hidden}" + ("_add_dresidual" if flag else "") + f"_{suffix}"
            out[name] = env.get_template("norm_bwd.cu.j2").render(
                kernel_name=name, add_dresidual=flag, eps="0.0f",
                header_comment=f"// {name}: compile check", **common)
        for columns in sorted({h * m for h in HIDDEN for m in (1, 2)}):
            name = f"column_sum_n{columns}_{suffix}"
            out[name] = env.get_template("column_sum.cu.j2").render(
                kernel_name=name, ctype=ctype, columns=columns, header_comment=f"// {name}: compile check")
    return out


def _read(prog, get_size, get) -> bytes:
    _, size = get_size(prog)
    buffer = bytearray(size)
    get(prog, buffer)
    return bytes(buffer).rstrip(b"\0")


def compile_one(job: tuple[str, str, str, str]) -> tuple[str, str, bool, str, int]:
    """Returns (name, target, ok, log, binary size). sm_XX targets run ptxas -v for the stats."""
    name, source, target, include = job
    options = [f"--gpu-architecture={target}", "--std=c++17", f"-I{CUDA_HEADERS}", f"-I{include}"]
    if target.startswith("sm_"):
        options.append("--ptxas-options=-v")
    result, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS, result
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        log = _read(prog, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog).decode(errors="replace")
        ok = result == nvrtc.nvrtcResult.NVRTC_SUCCESS
        size = 0
        if ok:
            if target.startswith("compute_"):
                size = len(_read(prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
            else:
                size = len(_read(prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return name, target, ok, log, size


def warnings_in(log: str) -> list[str]:
    """Log lines that are not ptxas -v statistics (those are info, anything else is a diagnostic)."""
    return [line for line in log.splitlines()
            if line.strip() and not re.match(r"ptxas\s+(info\s*:|\.)", line)]


STATS = re.compile(r"Function properties for (\S+)\n\S*\s*\.?\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                   r"(\d+) bytes spill loads\nptxas info\s*: Used (\d+) registers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    args = parser.parse_args()

    include = str(cuda_include_dir())
    srcs = sources()
    jobs = [(name, src, "sm_90", include) for name, src in srcs.items()]
    # Older arch and PTX: one of each family and dtype is enough to catch arch-specific trouble.
    extra = ["activations_all", "add_layernorm_fwd_h4104_bf16", "rmsnorm_zc_bwd_h4096_add_dresidual_fp16",
             "layernorm_bwd_h768_fp32", "column_sum_n8208_bf16"]
    jobs += [(name, srcs[name], target, include) for name in extra for target in ("sm_80", "compute_80")]

    failures = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name, target, ok, log, size in pool.map(compile_one, jobs):
            problems = warnings_in(log)
            if not ok or problems:
                failures += 1
                print(f"FAIL {name} [{target}]\n{log.strip()}\n")
                continue
            stats = "; ".join(f"{fn}: {regs} regs, {st}/{ld} B spill st/ld, {stack} B stack"
                              for fn, stack, st, ld, regs in STATS.findall(log))
            if any(int(st) or int(ld) for _, _, st, ld, _ in STATS.findall(log)):
                print(f"SPILL {name} [{target}]: {stats}")
            elif not args.quiet:
                print(f"ok   {name} [{target}] {size} B" + (f"  ({stats})" if stats else ""))
    print(f"\n{len(jobs) - failures}/{len(jobs)} compiles clean (no warnings); {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
