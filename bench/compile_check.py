"""Compile-check every kernel family with NVRTC over a grid of shapes (no GPU needed).

The kernels come from the compiler itself: specs written here (norms with and without the
residual add, zero-centred gamma, LayerNorm and RMSNorm at several hidden sizes; every registered
elementwise op after a Bias, at several widths) are planned by the shipped rules and rendered by
the stage implementations, exactly as `fusegen generate` would; nothing here lists ops or
repeats kernel geometry. Each is compiled for sm_90 (cubin, with ptxas -v so registers and spills
can be reported), a sample also for sm_80 and compute_80 (PTX). Any warning counts as a failure.

    .venv/bin/python bench/compile_check.py [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cuda.bindings import nvrtc

from fusegen import build, emit, fusion_rules
from fusegen.toolchain import nvrtc as fg_nvrtc
from fusegen.frontend import parse_spec
from fusegen.names import NameTable
from fusegen.ops import OPS, REQUIRED

ROOT = Path(__file__).resolve().parent.parent
CUDA_HEADERS = ROOT / "templates" / "cuda"
HIDDEN = (1024, 4096, 768, 4104)
SAMPLE = {"int": 8, "float": 0.5, "bool": True}  # a value for an argument that has no default


def _call(name: str) -> str:
    """A spec call of op ``name`` with its required arguments filled in."""
    args = [repr(SAMPLE[a.kind]) for a in OPS[name].args if a.default is REQUIRED]
    return f"{name}({', '.join(args)})"


def spec_text() -> str:
    lines = ["from transformer_engine.pytorch.ops import *"]
    for h in HIDDEN:
        for norm in ("LayerNorm", "RMSNorm"):
            for zc in (False, True):
                op = f"{norm}({h}, zero_centered_gamma={zc})"
                tag = f"{norm.lower()}_{h}_{int(zc)}"
                lines.append(f"{tag} = Sequential({op})")
                lines.append(f"add_{tag} = Sequential(AddExtraInput(), MakeExtraOutput(), {op})")
        for name, op in OPS.items():  # every elementwise op with a functor, after a Bias the GEMM does not take
            if op.device_struct and not op.operand:
                width = 2 * h if op.halves_width else h
                lines.append(f"{name.lower()}_{h} = Sequential(Bias({width}), {_call(name)})")
    return "\n".join(lines) + "\n"


def sources() -> dict[str, str]:
    """{kernel: CUDA source} for every kernel the specs above need, each source in every dtype."""
    plans = build.plan_specs(parse_spec(spec_text(), "compile_check.py"), NameTable(), fusion_rules.FORWARD_RULES,
                             fusion_rules.BACKWARD_RULES)
    unique, _ = build.collect_kernels(plans)
    env = emit.environment()
    return {name: build.cuda_source(spec, ("float32", "float16", "bfloat16"), env) for name, spec in unique.items()}


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

    include = str(fg_nvrtc.cuda_include_dir())
    srcs = sources()
    jobs = [(name, src, "sm_90", include) for name, src in srcs.items()]
    # Older arch and PTX: a sample of every family is enough to catch arch-specific trouble.
    extra = sorted(srcs)[::max(1, len(srcs) // 12)]
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
