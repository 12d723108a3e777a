"""The plans' bytes/token column (emit.traffic_cells, StageImpl.row_traffic) against what the
generated modules' kernel launchers and GEMM calls actually take and return: every shipped
pipeline is run on CPU in bf16 with its launchers and torch's GEMM entry points wrapped, and the
tensors each call reads and writes are counted per token; forward, backward and the no-grad
forward must each add up to the plan's column, byte for byte."""

import functools
import inspect
from pathlib import Path

import pytest
import torch

import generated
from generated import _kernels, _reference
from fusegen import build, emit
from fusegen.config import load_config
from references import INPUT_SHAPES

ROOT = Path(__file__).resolve().parents[2]
ROWS = 13  # no feature size of a shipped spec is a multiple of 13: a tensor whose numel is, is per token
CONFIG = load_config([], None, None, None, None, supported_archs=None, cwd=ROOT)
PLANS = {plan.pipeline.class_name: plan for plan in build.load_plans(CONFIG)}


def per_token_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        # a norm's statistics: fp32 from the CUDA kernels the plan describes, float64 from the CPU
        # launchers' reference math (templates/kernels.py.j2), which keeps one rounding at the end
        size = 4 if value.dtype == torch.float64 else value.element_size()
        return value.numel() // ROWS * size if value.numel() % ROWS == 0 else 0
    if isinstance(value, (tuple, list)):
        return sum(per_token_bytes(v) for v in value)
    return 0


class Recorder:
    """Bytes of the per-token tensors that the outermost wrapped calls read and write (a launcher's
    own CPU math, or a column sum it calls, is inside it and not counted again)."""

    def __init__(self):
        self.total, self.depth = 0, 0

    def wrap(self, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            try:
                result = fn(*args, **kwargs)
            finally:
                self.depth -= 1
            self.total += per_token_bytes(args) + per_token_bytes(tuple(kwargs.values())) + per_token_bytes(result)
            return result
        return counted


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    for name, fn in vars(_kernels).items():  # every launcher the pipelines call as kernels.<name>
        if inspect.isfunction(fn) and fn.__module__ == _kernels.__name__ and not name.startswith("_"):
            monkeypatch.setattr(_kernels, name, rec.wrap(fn))
    for owner, name in ((torch, "addmm"), (torch, "_addmm_activation"), (torch.Tensor, "mm"),
                        (_reference, "addmm_gelu"), (_reference, "accumulate_into_main_grad")):
        monkeypatch.setattr(owner, name, rec.wrap(getattr(owner, name)))
    return rec


def known(cells):
    return all(cell != "—" for cell in cells)


def column(plan, pass_):
    cells = emit.traffic_cells(plan)
    stages = {"forward": plan.forward, "backward": plan.backward, "inference": plan.inference}[pass_]
    return [cells[(pass_, stage.start)] for stage in stages]


# (not the modules whose x is not [tokens, in_features], INPUT_SHAPES': a tensor's numel per row of
# x is not its size per token there)
MEASURABLE = sorted(name for name, plan in PLANS.items() if name not in INPUT_SHAPES
                    and all(known(column(plan, p)) for p in ("forward", "backward", "inference")))


def inputs(module):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, module.in_features or 64, generator=gen).bfloat16().requires_grad_()
    extra = [torch.randn((ROWS,) if n == "rows" else (ROWS, n), generator=gen).bfloat16().requires_grad_()
             for n in module.extra_input_features]
    return [x, *extra]


def total(cells):
    return sum(float(cell.replace(",", "")) for cell in cells)


@pytest.mark.parametrize("name", MEASURABLE)
def test_bytes_per_token_add_up_to_what_the_calls_move(name, recorder):
    plan = PLANS[name]
    # the bytes do not depend on the values: the parameters are left as allocated, not initialised
    # (TeMlp's 176M would take seconds)
    module = torch.nn.utils.skip_init(getattr(generated, name), dtype=torch.bfloat16)
    args = inputs(module)
    outputs = module(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    forward, recorder.total = recorder.total, 0
    torch.autograd.backward([o for o in outputs if o.requires_grad],
                            [torch.ones_like(o) for o in outputs if o.requires_grad])
    backward, recorder.total = recorder.total, 0
    with torch.no_grad():
        module(*[a.detach() for a in args])
    no_grad = recorder.total
    assert (forward, backward, no_grad) == (total(column(plan, "forward")), total(column(plan, "backward")),
                                            total(column(plan, "inference")))


def test_most_pipelines_are_measured_and_the_plan_shows_the_column():
    assert len(MEASURABLE) >= 25, MEASURABLE
    plan_md = (ROOT / "generated" / "te_mlp.plan.md").read_text()
    # TE's MLP by hand, bf16: LayerNorm reads x and writes y (2 x 4096 x 2 B) and mean, rstd (8 B);
    # the GEMMs x and y; SwiGLU 28672 in, 14336 out; backward: the norm dy, x, dx + the statistics,
    # each GEMM dy twice (dgrad, wgrad), x (wgrad) and dx, Bias+SwiGLU dy, x, dx, Bias dy only.
    for row in ("| `layernorm_fwd_h4096` | 16,392 |", "| cuBLAS GEMM (torch) | 65,536 |",
                "| `swiglu_fwd_n14336` | 86,016 |", "| cuBLAS GEMM (torch) | 36,864 |",
                "| `layernorm_bwd_h4096` + (`column_sum_n8192` above 32 rows) | 24,584 |",
                "| cuBLAS dgrad + wgrad GEMMs (torch) | 131,072 |",
                "| `bias_swiglu_bwd_n14336` + (`column_sum_n28672` above 128 rows) | 143,360 |",
                "| cuBLAS dgrad + wgrad GEMMs (torch) | 73,728 |", "| `bias_bwd_n4096` + (`column_sum_n4096` above 128 rows) | 8,192 |"):
        assert row in plan_md, row
