"""GEMM stages: BasicLinear through cuBLAS via torch, with what its epilogue can absorb.

Forward y = x W^T (``torch.addmm``: y = beta C + alpha x W^T), absorbing
- a following Bias: C = the bias (TE's ForwardLinearBiasActivation, without the activation);
- a following ConstantScale s: alpha = s (and beta = s with a Bias: s (x W^T + b));
- a following Bias and ReLU: cuBLASLt's bias + ReLU epilogue (``torch._addmm_activation``; TE's
  ForwardLinearBiasActivation forms only the bias), the ReLU's backward then reading its output;
- a following AddExtraInput r: C = r, beta = 1, the GEMM accumulating into the residual (TE's
  ForwardLinearBiasAdd / ForwardLinearScaleAdd; a Bias as well would need two C operands);
- in the no-grad forward only, a following Bias and GELU: cuBLASLt's bias + GELU epilogue (the
  GELU's backward would read the pre-activation, which the epilogue does not keep).
Backward dgrad dy W and wgrad dy^T x; a ConstantScale right after the linear becomes both GEMMs'
alpha (TE's BackwardLinearScale); a MakeExtraOutput just before the linear has its output grad
accumulated into dgrad (``beta=1``, TE's BackwardLinearAdd). The wgrad adds into a ``weight.grad``
that autograd would otherwise add it into (``ref.weight_grad``, ops/linear.py). Nothing else fits a
GEMM call, so ``check`` refuses any other chain: a rule asking for, say, a GELU in the epilogue
fails when it is defined.
"""

from __future__ import annotations

from ..calls import TorchCall
from ..values import HOST_OBJECT, Role
from .base import RowTraffic, Saves, StageImpl, fixed
from .quantize import fp8_kernels

FORMS = {
    "forward": {("linear",): "GEMM", ("linear", "bias"): "GEMM with the bias in its epilogue",
                ("linear", "scale"): "GEMM with the scale as alpha",
                ("linear", "bias", "scale"): "GEMM with the bias in its epilogue and the scale as alpha and beta",
                ("linear", "bias", "relu"): "GEMM with the bias and the ReLU in its epilogue",
                ("linear", "add_extra_input"): "GEMM accumulating into the extra input (beta=1)",
                ("linear", "scale", "add_extra_input"): "GEMM with the scale as alpha, accumulating into the "
                                                        "extra input (beta=1)"},
    # the no-grad forward (plan.INFERENCE): the forward forms, and what only a forward without a
    # backward can use
    "inference": {("linear", "bias", "gelu"): "GEMM with the bias and the GELU in its epilogue"},
    "backward": {("linear",): "dgrad and wgrad GEMMs",
                 ("linear", "scale"): "dgrad and wgrad GEMMs with the scale as alpha",
                 ("make_extra_output", "linear"): "dgrad accumulating the extra output's grad"},
}


class GemmStage(StageImpl):
    name = "gemm"

    def check(self, pass_, chain):
        forms = {**FORMS["forward"], **FORMS["inference"]} if pass_ == "inference" else FORMS[pass_]
        if tuple(chain) in forms:
            return None
        can = "; ".join(" + ".join(form) for form in forms)
        return f"a {'no-grad forward' if pass_ == 'inference' else pass_} GEMM stage runs only these op chains: {can}"

    def saves(self, pipeline, stage, have):
        return Saves(values=frozenset({stage.first("linear").input}))  # wgrad reads the GEMM input

    def runs_as(self, pass_, stage, kernels):
        return "cuBLAS GEMM (torch)" if pass_ == "forward" else "cuBLAS dgrad + wgrad GEMMs (torch)"

    def row_traffic(self, plan, pass_, stage):
        x, y = plan.pipeline.features(stage.input), plan.pipeline.features(stage.output)
        if not fixed(x, y):
            return None
        if pass_ == "backward":  # dgrad reads dy, writes dx (+ reads the extra output's grad); wgrad reads dy, x
            return RowTraffic(2 * y + 2 * x + (x if stage.first("make_extra_output") else 0))
        return RowTraffic(x + y + (y if stage.first("add_extra_input") else 0))  # x, y (+ the residual as C)

    def forward(self, em, stage, block):
        if em.fp8 is not None:
            return self.fp8_forward(em, stage, block)
        linear, bias, scale, add = (stage.first(kind) for kind in ("linear", "bias", "scale", "add_extra_input"))
        io = dict(x=stage.input, w=linear.param("weight"))
        out = dict(y=stage.output)
        if stage.first("relu") is not None:
            block.add(TorchCall("{y} = torch._addmm_activation({b}, {x}, {w}.t())", dict(io, b=bias.param("bias")), out))
            return em.table[stage.output].name
        if stage.first("gelu") is not None:  # cuBLASLt's bias + GELU epilogue on CUDA (ops/activations.py)
            block.add(TorchCall("{y} = ref.addmm_gelu({b}, {x}, {w})", dict(io, b=bias.param("bias")), out))
            return em.table[stage.output].name
        alpha = f", alpha={scale.args['scale']!r}" if scale is not None else ""
        if add is not None:  # beta = 1: the GEMM accumulates into the residual
            block.add(TorchCall("{y} = torch.addmm({r}, {x}, {w}.t()" + alpha + ")", dict(io, r=add.extra_in), out))
        elif bias is not None:
            beta = f", beta={scale.args['scale']!r}" if scale is not None else ""  # s (x W^T + b)
            block.add(TorchCall("{y} = torch.addmm({b}, {x}, {w}.t()" + beta + alpha + ")",
                                dict(io, b=bias.param("bias")), out))
        elif scale is not None:  # beta = 0: C is never read
            block.add(TorchCall("{y} = torch.addmm({x}.new_zeros(()), {x}, {w}.t(), beta=0" + alpha + ")", io, out))
        else:
            block.add(TorchCall("{y} = {x}.mm({w}.t())", io, out))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        if em.fp8 is not None:
            return self.fp8_backward(em, stage, block, dy, d_in)
        linear, meo, scale = stage.first("linear"), stage.first("make_extra_output"), stage.first("scale")
        weight = linear.param("weight")
        alpha = f", alpha={scale.args['scale']!r}" if scale is not None else ""
        reads = dict(dy=dy, w=weight)
        if scale is not None:  # d(x W^T) = s dy: the scale as both GEMMs' alpha
            text = "{dx} = torch.addmm({dy}.new_zeros(()), {dy}, {w}, beta=0" + alpha + ")"
        elif meo is not None:  # beta = 1: dgrad accumulates into the extra output's grad
            text = "{dx} = torch.addmm({d_extra}, {dy}, {w})"
            reads["d_extra"] = em.grad(meo.extra_out)
        else:
            text = "{dx} = {dy}.mm({w})"
        block.add(TorchCall(text, reads, dict(dx=d_in)))
        # TE's option accumulate_into_main_grad: dW goes into weight.main_grad
        helper = "accumulate_into_main_grad(" if linear.args["accumulate_into_main_grad"] else "weight_grad(ctx, "
        wgrad = TorchCall(f"ref.{helper}{{w}}, {{dy}}, {{x}}{alpha})", dict(w=weight, dy=dy, x=linear.input))
        # kept apart from the stage's other calls: it may run after every stage
        block.weight_grad_calls.append((em.grad(weight), wgrad))
        return d_in

    # The FP8 emission (issue 40): the same forms through the runtime's Fp8Call, which casts each
    # operand with the autocast recipe's scales (the quantize family's kernels) and runs
    # torch._scaled_mm (fp8.py). The forward returns x's FP8 transpose and the FP8 weight beside y,
    # which the backward reads: its weight grad multiplies that transpose, its dgrad that weight.
    def kernels(self, plan, stage, pass_):
        return fp8_kernels(plan.pipeline.fp8.recipes) if plan.pipeline.fp8 else []

    def fp8_forward(self, em, stage, block):
        linear, bias, scale, add, relu, gelu = (stage.first(kind) for kind in (
            "linear", "bias", "scale", "add_extra_input", "relu", "gelu"))
        reads = dict(fp8=em.fp8, x=stage.input, w=linear.param("weight"))
        extra = ""
        if bias is not None:
            reads["b"] = bias.param("bias")
            extra += ", {b}"
        if scale is not None:
            extra += f", alpha={scale.args['scale']!r}"
        if add is not None:
            reads["r"] = add.extra_in
            extra += ", add={r}"
        if relu is not None or gelu is not None:
            extra += f", activation={'relu' if relu is not None else 'gelu'!r}"
        if stage.input in em.fp8_amaxes:  # x's amax, kept by the kernel that wrote x
            reads["amax"] = em.fp8_amaxes[stage.input][0]
            extra += ", amax={amax}"
        call = f"{{fp8}}.linear({gemm_number(em, linear)}, {{x}}, {{w}}{extra})"
        if not em.saving:  # the no-grad forward: y alone
            block.add(TorchCall("{y}, _, _ = " + call, reads, dict(y=stage.output)))
            return em.table[stage.output].name
        x_fp8 = em.table.add(Role.OBJECT, HOST_OBJECT, f"{em.name(stage.input)}_fp8_t")
        weight_fp8 = em.table.add(Role.OBJECT, HOST_OBJECT, f"{em.name(linear.param('weight'))}_fp8")
        em.stats[linear.index] = [x_fp8, weight_fp8]
        block.add(TorchCall("{y}, {x_fp8}, {w_fp8} = " + call, reads,
                            dict(y=stage.output, x_fp8=x_fp8, w_fp8=weight_fp8)))
        return em.table[stage.output].name

    def fp8_backward(self, em, stage, block, dy, d_in):
        linear, meo, scale = stage.first("linear"), stage.first("make_extra_output"), stage.first("scale")
        x_fp8, weight_fp8 = em.stats[linear.index]
        weight = linear.param("weight")
        # dy cast once for both GEMMs (a grad's own: the weight grad after the stages reads it)
        dy_fp8 = em.table.add(Role.OBJECT, HOST_OBJECT, f"{em.name(dy)}_fp8", grad_of=em.table[dy].grad_of)
        reads, amax = dict(fp8=em.fp8, dy=dy), ""
        if dy in em.fp8_amaxes:  # dy's amax, kept by the kernel that wrote dy
            reads["amax"], amax = em.fp8_amaxes[dy][0], ", amax={amax}"
        block.add(TorchCall(f"{{dy_fp8}} = {{fp8}}.grad_output({gemm_number(em, linear)}, {{dy}}{amax})",
                            reads, dict(dy_fp8=dy_fp8)))
        alpha = f", alpha={scale.args['scale']!r}" if scale is not None else ""
        reads = dict(fp8=em.fp8, dy_fp8=dy_fp8, w_fp8=weight_fp8)
        extra = alpha
        if meo is not None:  # dgrad accumulates into the extra output's grad
            reads["d_extra"] = em.grad(meo.extra_out)
            extra += ", add={d_extra}"
        block.add(TorchCall("{dx} = {fp8}.dgrad({dy_fp8}, {w_fp8}" + extra + ")", reads, dict(dx=d_in)))
        # (x itself is not read: the forward handed what the weight grad needs of it, x_fp8)
        text = "{fp8}.weight_grad({w}, {dy_fp8}, {x_fp8}" + alpha + ")"
        if linear.args["accumulate_into_main_grad"]:  # TE's option: dW, in fp32, into weight.main_grad
            text = "ref.add_into_main_grad({w}, " + text[:-1] + ", out_dtype=torch.float32))"
        wgrad = TorchCall(text, dict(fp8=em.fp8, w=weight, dy_fp8=dy_fp8, x_fp8=x_fp8))
        block.weight_grad_calls.append((em.grad(weight), wgrad))
        return d_in


GEMM = GemmStage()


def gemm_ops(pipeline) -> tuple:
    """A pipeline's GEMMs (each Linear's BasicLinear) in chain order: an FP8 GEMM's number is its
    place here (the runtime's Fp8Call and the module's fp8_gemms count them so)."""
    return tuple(op for op in pipeline.ops if op.kind == "linear")


def gemm_number(em, linear) -> int:
    """An FP8 GEMM's number: the op's place among the pipeline's GEMMs (its slots in the Fp8Call's
    list)."""
    return gemm_ops(em.pipeline).index(linear)


def fp8_operands(plan, pass_: str) -> frozenset[int]:
    """In a pipeline built for FP8, the values a GEMM stage casts to FP8 (``pass_`` "forward": each
    GEMM's x; "backward": each GEMM stage's output, whose grad it casts); the kernel that writes
    one may keep its amax (fp8_amax), which current scaling's cast then reads."""
    if not plan.pipeline.fp8:
        return frozenset()
    if pass_ == "backward":
        return frozenset(stage.output for stage in plan.backward if stage.first("linear") is not None)
    return frozenset(op.input for op in gemm_ops(plan.pipeline))


def fp8_amax(em, block, stage, pass_: str, value: int, spec, args: list):
    """The launch of a stage's kernel ``spec`` on ``args`` where the kernel writes ``value``
    (forward: the stage's output; backward: its input's grad) and an FP8 GEMM casts it: the
    kernel's variant that keeps the amax (the first of the stage's kernels with ``amax`` in its
    context) and ``args`` with the amax value it fills appended, the call's (``Fp8Call.amax``: None
    where the recipe takes none), which the GEMM's cast then reads instead of an amax pass. Returns
    (spec, args): as given in high precision, or where the stage has no such kernel."""
    variant = _fp8_variant(em, stage, pass_, "amax")
    if variant is None:
        return spec, args
    # (a grad's own in the backward: made there, never saved by the forward)
    grad_of = em.table[value].grad_of if pass_ == "backward" else None
    amax = em.table.add(Role.OBJECT, HOST_OBJECT, f"{em.name(value)}_amax", grad_of=grad_of)
    block.add(TorchCall("{amax} = {fp8}.amax()  # kept by the kernel below for its FP8 cast (current scaling)",
                        dict(fp8=em.fp8), dict(amax=amax)))
    em.fp8_amaxes[value] = (amax, variant.name)
    return variant, [*args, amax]


def fp8_only(plan, value: int, pass_: str) -> bool:
    """Whether the kernel that writes ``value`` (forward: an FP8 GEMM's x; backward: a GEMM
    stage's output, whose grad it writes) may write it in FP8 alone (its FP8 variant): nothing but
    the GEMM reads it in high precision. One op reads the value (so its grad has no other part),
    it is no output, residual or extra output of the pipeline; forward, no stage's backward but
    the GEMM's keeps it (the GEMM's keeps its FP8 transpose instead)."""
    p = plan.pipeline
    outside = {p.output, *p.residual_values, *(op.extra_out for op in p.ops if op.extra_out is not None)}
    if value in outside or sum(op.input == value for op in p.ops) != 1:
        return False
    if pass_ == "backward":
        return True
    have = frozenset(v for stage in plan.forward for v in stage.rule.stage.materialises(stage))
    return not any(value in stage.rule.stage.saves(p, stage, have).values for stage in plan.backward
                   if getattr(stage.first("linear"), "input", None) != value)


def fp8_producer(em, stage, pass_: str, written: int):
    """The FP8 emission of a stage whose kernel writes ``written`` (forward: its output, an FP8
    GEMM's x; backward: its input's grad, a GEMM stage's output's): its kernel's FP8 variant (the
    stage's kernel with ``fp8_out`` in its context, listed where fp8_only allows it) and the number
    of the GEMM that reads the value, which ``Fp8Call.produce`` launches it for. None: high
    precision, or no such kernel."""
    spec = _fp8_variant(em, stage, pass_, "fp8_out")
    if spec is None:
        return None
    if pass_ == "forward":
        linear = next(op for op in gemm_ops(em.pipeline) if op.input == stage.output)
    else:
        linear = next(s.first("linear") for s in em.plan.backward if s.output == stage.input and s.first("linear"))
    em.fp8_written[written] = spec.name
    return spec, gemm_number(em, linear)


def _fp8_variant(em, stage, pass_: str, key: str):
    """In the FP8 emission, the first of the stage's kernels with ``key`` in its context (a
    producer's variant for an FP8 GEMM), or None."""
    if em.fp8 is None:
        return None
    return next((spec for spec in em.stage_kernels.get((pass_, stage.start), ()) if spec.ctx.get(key)), None)
