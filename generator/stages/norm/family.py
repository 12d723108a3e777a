"""The norm kernel families, norm_fwd and norm_bwd: how their kernels are instantiated
(templates/norm/*.cu.j2) and launched (templates/norm/*.py.j2), one block a row."""

from __future__ import annotations

from ...kernels import KernelFamily, KernelSpec, register_family
from ..elementwise.steps import random_operands
from .tuning import NORM_BWD_MIN_BLOCKS, SUMS_IN_KERNEL_SPLITS, norm_fwd_few_rows, norm_fwd_holds, norm_threads


class NormForward(KernelFamily):
    name = "norm_fwd"
    template = "norm/norm_fwd.cu.j2"
    launcher_template = "norm/norm_fwd.py.j2"

    def launch_size(self, spec, itemsize):
        """Threads a block (a block a row)."""
        return norm_threads(spec.ctx["hidden"], spec.vec(itemsize))

    def _shape(self, spec: KernelSpec, itemsize: int) -> tuple:
        """The kernel's arguments to norm_fwd_holds and norm_fwd_few_rows."""
        ctx = spec.ctx
        params = 0 if ctx["l2"] else 2 if ctx["layernorm"] else 1
        return (ctx["hidden"], spec.vec(itemsize), self.launch_size(spec, itemsize), itemsize, params,
                ctx["residual"], ctx["writes_h"])

    def few_rows(self, spec, itemsize):
        return norm_fwd_few_rows(*self._shape(spec, itemsize))

    def template_context(self, spec, dtype, itemsize):
        # (HOLD_PARAMS, LOADS_FIRST) of each entry point; None: no few-rows entry
        shape = self._shape(spec, itemsize)
        return dict(threads=self.launch_size(spec, itemsize), holds=norm_fwd_holds(*shape, few_rows=False),
                    few_rows_holds=norm_fwd_holds(*shape, few_rows=True) if norm_fwd_few_rows(*shape) else None)

    def launcher_io(self, spec):
        ctx = spec.ctx
        args = ["x", *spec.operands] + (["residual"] if ctx["residual"] else []) + ([] if ctx["l2"] else ["gamma"])
        args += ["beta"] if ctx["layernorm"] else []
        # an FP8 GEMM's x: last, the float its amax is max-ed into (or None), written in place
        amax = ["amax"] if ctx.get("amax") else []
        return dict(args=args + amax, outputs=2 + ctx["writes_h"] + ctx["layernorm"],  # y, [h], [mean], rstd
                    random=random_operands(ctx["steps"]) + amax,  # its prologue's and epilogue's, the amax
                    types={"amax": "Tensor(a!)?"} if amax else {})

    def runtime_names(self, spec):
        # off the GPU, the amax variant's launcher keeps the amax with the quantize family's reference
        return super().runtime_names(spec) + (("fp8_reference_amax",) if spec.ctx.get("amax") else ())


class NormBackward(KernelFamily):
    name = "norm_bwd"
    template = "norm/norm_bwd.cu.j2"
    launcher_template = "norm/norm_bwd.py.j2"
    head_template = "norm/norm_bwd_head.py.j2"
    head_position = 20  # kernels.KernelFamily.head_position
    module_constants = {"sums_in_kernel_splits": SUMS_IN_KERNEL_SPLITS}

    def launch_size(self, spec, itemsize):
        """Threads a block (a block a row split)."""
        return norm_threads(spec.ctx["hidden"], spec.vec(itemsize), backward=True,
                            shared_partials=spec.ctx["shared_partials"])

    def shared_bytes(self, spec):
        """Its fp32 parameter-grad partials, where they fit (tuning.norm_bwd_shared_partials)."""
        return 4 * spec.ctx["grad_columns"] if spec.ctx["shared_partials"] else 0

    def sums_itself_up_to(self, spec):
        return SUMS_IN_KERNEL_SPLITS if spec.ctx["single_launch"] else None

    def template_context(self, spec, dtype, itemsize):
        threads = self.launch_size(spec, itemsize)
        if not spec.ctx["shared_partials"]:
            return dict(threads=threads)
        # two blocks an SM where 64 registers a thread hold the row
        return dict(threads=threads, min_blocks=NORM_BWD_MIN_BLOCKS if threads * NORM_BWD_MIN_BLOCKS <= 1024 else 1)

    def launcher_io(self, spec):
        ctx = spec.ctx
        args = ["dy", "x"] + (["mean"] if ctx["layernorm"] else []) + ["rstd"] + ([] if ctx["l2"] else ["gamma"])
        args += ["dresidual"] if ctx["add_dresidual"] else []
        return dict(args=args, outputs=1 if ctx["l2"] else 2 + ctx["layernorm"])  # dx, [dgamma, [dbeta]]


NORM_FWD = register_family(NormForward())
NORM_BWD = register_family(NormBackward())
