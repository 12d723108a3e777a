"""One ABI per kernel (kernels.kernel_abi): the .cu signature and the Python launch tuple of every
shipped kernel are both rendered from it, so they agree parameter for parameter."""

import re
from pathlib import Path

import pytest

from fusegen import build
from fusegen import kernels as kn
from fusegen.config import load_config

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "generated"


def shipped_specs():
    config = load_config([], None, None, None, None, supported_archs=None, cwd=ROOT)
    unique, _ = build.collect_kernels(build.load_plans(config))
    return list(unique.values())


SPECS = shipped_specs()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_signature_and_launch_tuple_come_from_one_abi(spec):
    abi = kn.kernel_abi(spec)
    source = (GENERATED / "kernels" / f"{spec.name}_fp32.cu").read_text()
    signature = re.search(rf"{spec.name}_fp32\((.*?)\) {{", source, re.S).group(1)
    declared = [re.sub(r"\s+", " ", p.strip()) for p in signature.split(",")]
    assert declared == [f"{p.ctype}{' __restrict__' if '*' in p.ctype else ''} {p.name}" for p in abi]
    launchers = (GENERATED / "_kernels.py").read_text()
    # the Kernel's signature letters and every launch tuple: pointers as ints (0: not passed;
    # pointer(t): a Dropout key, None in eval mode), C ints as they are
    letters = "".join("p" if p.pointer else "i" for p in abi)
    assert f'_{spec.name.upper()} = Kernel("{spec.name}", "{letters}")' in launchers
    random = {dict(step)["operand"] for step in dict(spec.context).get("steps", ()) if dict(step)["broadcast"] == "random"}
    values = [("0" if not p.passed else p.name if not p.pointer else f"pointer({p.name})" if p.name in random
               else f"{p.name}.data_ptr()") for p in abi]
    launches = re.findall(rf"(?<!\w)_{spec.name.upper()}\.launch\((.*)\)\n", launchers)
    assert all(launch.endswith(".get_device()") for launch in launches)
    if spec.family == "norm_fwd":  # and its launcher for a forward without autograd: no statistics, a sum if kept
        no_grad = ["0" if p.name in ("mean", "rstd") else "(residual_out.data_ptr() if keep_sum else 0)"
                   if p.name == "residual_out" and p.passed else v for p, v in zip(abi, values)]
        assert len(launches) == 2 and f", ({', '.join(no_grad)}), " in launches[1]
        launches = launches[:1]
    assert launches and all(f", ({', '.join(values)}), " in launch for launch in launches)


def test_every_family_is_covered():
    assert {s.family for s in SPECS} == {"norm_fwd", "norm_bwd", "column_sum", "elementwise_fwd", "elementwise_bwd"}
