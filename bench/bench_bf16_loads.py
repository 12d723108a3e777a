"""Device time of the sweep's bf16 kernels for one build of bench/specs/sweep.py: how a kernel turns
a loaded bf16 into fp32 (templates/cuda/common.cuh: ``to_float``). bench/NOTES.md (2026-11-26) has
the numbers.

cuda_bf16.h converts with cvt.f32.bf16 from sm_90 on and with a mov below; common.cuh uses the
mov on every arch, so that sm_90's PTX is sm_80's (nvrtc.ASSEMBLED_FROM). Each package is the
sweep generated for sm_90, e.g. with the header as it was:

    git show 78e0ec5:templates/cuda/common.cuh > templates/cuda/common.cuh
    cd bench && fusegen generate --out /tmp/cvt/sweep                # then restore the header

and each runs in its own process (the packages register the same op names), several times in
turn, the checkout's own build too:

    python bench/bench_bf16_loads.py cvt /tmp/cvt >> bf16_loads.tsv
    python bench/bench_bf16_loads.py mov bench/build >> bf16_loads.tsv

Columns: label, family, tokens, width, pass, device µs (bench_kernels.timed: the fastest of 4
batches, each queued behind a sleep so the host's pace does not count).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(sys.argv[2]).resolve()))
import sweep  # noqa: E402,F401  (the package under test; bench_kernels' own `import sweep` finds it)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as B  # noqa: E402

TOKENS = (512, 16384)


def main(label: str) -> None:
    for family in B.FAMILIES:
        for width in family.widths:
            for tokens in TOKENS:
                gen = torch.Generator(device="cuda").manual_seed(width + tokens)
                module = family.module(width)
                inputs = [torch.randn(tokens, width, generator=gen, device="cuda", dtype=B.DTYPE)
                          for _ in range(1 + family.extra_inputs)]
                for pass_name, fn in zip(("fwd", "fwd+bwd"), B.passes(module, inputs, [])):
                    device, _ = B.timed(fn)
                    print(f"{label}\t{family.name}\t{tokens}\t{width}\t{pass_name}\t{device:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
