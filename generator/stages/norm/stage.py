"""Norm stages: LayerNorm / RMSNorm as a generated row kernel, with what comes before it fused in.

Forward: [prologue] [AddExtraInput] [MakeExtraOutput] Norm. The prologue is elementwise ops on the
input (Bias, Dropout, ConstantScale: "bias, dropout, add" then the norm), applied as each vector
is loaded, with the same functors as an elementwise kernel's. With a prologue or the add, the
kernel writes h = prologue(x) [+ r] (the MakeExtraOutput's output, and the norm input saved for
backward) and norm(h), saving fp32 mean/rstd. Backward: [AddExtraInput] [MakeExtraOutput] Norm:
the dx kernel adds the extra output's grad (the residual stream's), which is also AddExtraInput's
grad, with deterministic dgamma/dbeta partials, which the kernel adds itself at a few rows (one
cooperative launch, tuning.SUMS_IN_KERNEL_SPLITS), else one column-sum kernel; a prologue's ops
are an elementwise backward stage of their own.
"""

from __future__ import annotations

from ...calls import Expr, Launch, TorchCall, literal
from ...ops import OPS
from ...values import Role
from ..base import RowTraffic, Saves, StageImpl, fixed
from ..column_sum import column_sum
from ..elementwise import steps as ew
from ..gemm import fp8_amax, fp8_operands
from .kernels import NORM_KINDS, kernel_ops_of, norm_backward, norm_forward, norm_of, params_of


def _param_args(norm, attrs) -> list:
    """The norm's parameters as its kernels take them: one row of features, a parameter of a
    multi-dim normalized_shape viewed flat (its memory is that row)."""
    shapes = {attr: shape for attr, _, shape, _ in norm.params}
    return [Expr("{p}.view(-1)", p=norm.param(a)) if len(shapes[a]) > 1 else norm.param(a) for a in attrs]


def _param_grads_shaped(em, norm, block) -> None:
    """The calls that give a multi-dim norm's parameter grads their parameter's shape back."""
    for attr, _, shape, _ in norm.params:
        if len(shape) > 1:
            grad = em.grad(norm.param(attr))
            block.add(TorchCall("{shaped} = {flat}.view" + literal(repr(tuple(shape))), dict(flat=grad), dict(shaped=grad)))


def _kinds(fits) -> set[str]:
    """The op kinds whose every op ``fits``."""
    kinds: dict[str, bool] = {}
    for op in OPS.values():
        kinds[op.kind] = kinds.get(op.kind, True) and fits(op)
    return {kind for kind, ok in kinds.items() if ok}


def _elementwise_alone(op) -> bool:
    """Elementwise on one value at a time, with an operand, if any, that is a parameter (a column
    vector or a scalar) or a random draw: not a GLU, an extra input or output, or a per-row operand."""
    operand = op.operand
    return op.functor_form in ("unary", "binary") and not op.halves_width and (
        operand is None or (operand.source in ("param", "random") and operand.broadcast != "row"))


def prologue_kinds() -> set[str]:
    """Op kinds a norm kernel applies to its input before the residual add (Bias, Dropout,
    ConstantScale, activations)."""
    return _kinds(_elementwise_alone)


def epilogue_kinds() -> set[str]:
    """Op kinds a norm kernel applies to its output before storing it: those whose backward does
    not read their input too (Dropout, Bias, ConstantScale), since the norm's own output is then
    never written."""
    return _kinds(lambda op: _elementwise_alone(op) and not op.needs_input_in_backward)


def _split_chain(chain) -> tuple[list[str], list[str], list[str]] | None:
    """(prologue, middle, epilogue) of prologue* [add_extra_input] [make_extra_output] norm
    epilogue*; None for any other chain."""
    chain = list(chain)
    at = next((i for i, kind in enumerate(chain) if kind in NORM_KINDS), None)
    if at is None:
        return None
    prologue = []
    for kind in chain[:at]:
        if kind not in prologue_kinds():
            break
        prologue.append(kind)
    middle, epilogue = chain[len(prologue):at + 1], chain[at + 1:]
    rest = middle[:-1]
    for optional in ("add_extra_input", "make_extra_output"):
        if rest[:1] == [optional]:
            rest.pop(0)
    if rest or not all(kind in epilogue_kinds() for kind in epilogue):
        return None
    return prologue, middle, epilogue


class NormStage(StageImpl):
    name = "norm"

    def check(self, pass_, chain):
        split = _split_chain(chain)
        if split is not None:
            prologue, middle, epilogue = split
            if pass_ == "forward" or (not prologue and not epilogue):
                return None
        if pass_ == "backward":
            return "a backward norm stage runs only [AddExtraInput] [MakeExtraOutput] norm"
        return ("a forward norm stage runs only [ops before] [AddExtraInput] [MakeExtraOutput] norm [ops after]; "
                f"the ops before are of kinds {', '.join(sorted(prologue_kinds()))}, the ops after of kinds "
                f"{', '.join(sorted(epilogue_kinds()))}")

    def materialises(self, stage):
        return {stage.input, stage.output, norm_of(stage).input}  # the (summed) norm input is written

    def saves(self, pipeline, stage, have):
        return Saves(values=frozenset({norm_of(stage).input}))

    def kernels(self, plan, stage, pass_):
        if pass_ == "forward":  # (and an FP8 GEMM's x: the variant that keeps its amax for the cast)
            return [norm_forward(stage), *([norm_forward(stage, amax=True)]
                                           if stage.output in fp8_operands(plan, "forward") else [])]
        spec = norm_backward(stage)
        return [spec, column_sum(spec.ctx["grad_columns"])] if spec.ctx["grad_columns"] else [spec]

    def row_traffic(self, plan, pass_, stage):
        norm, meo = norm_of(stage), stage.first("make_extra_output")
        h = norm.in_features
        if not fixed(h):
            return None
        spec = norm_backward(stage) if pass_ == "backward" else norm_forward(stage)
        stats = 2 if spec.ctx["layernorm"] else 1  # mean and rstd, or rstd
        if pass_ == "backward":  # dy, the saved sum, the statistics (+ the extra output's grad) -> dx
            return RowTraffic(3 * h + (h if meo else 0), stats)
        kernel_ops = kernel_ops_of(stage)
        operands = sum(ew.operand_width(plan.pipeline, stage, name, kernel_ops) for name in spec.operands)
        sum_written = spec.ctx["writes_h"] and (meo is not None or pass_ == "forward")
        # x (+ the residual, + per-row operands) -> y (+ the sum; + the statistics, for a backward)
        return RowTraffic(2 * h + (h if spec.ctx["residual"] else 0) + operands + (h if sum_written else 0),
                          stats if pass_ == "forward" else 0)

    def forward(self, em, stage, block):
        p, spec = em.pipeline, em.kernel("forward", stage)
        norm, add, meo = norm_of(stage), stage.first("add_extra_input"), stage.first("make_extra_output")
        for op in ew.random_ops(stage.ops):
            block.add(ew.new_seed(p, op, stage.input))
        operands = ew.io_names(stage, kernel_ops_of(stage))
        args = [stage.input] + [operands[o] for o in spec.operands] + ([add.extra_in] if add else [])
        args += _param_args(norm, params_of(norm))
        spec, args = fp8_amax(em, block, stage, "forward", stage.output, spec, args)  # y an FP8 GEMM's x
        results = [stage.output]
        if spec.ctx["writes_h"] and (meo or em.saving):  # the sum: an extra output, or read by the backward
            summed = meo.extra_out if meo else norm.input
            em.names[norm.input] = em.table[summed].name
            results.append(summed)
        elif not spec.ctx["writes_h"]:
            # nothing before the norm changes x: the norm's input (which its backward reads) is x,
            # also where a MakeExtraOutput stands between them and the stage starts at it
            em.names[norm.input] = em.name(stage.input)
            if meo:  # the extra output is x itself
                em.alias(block, meo.extra_out, stage.input)
        if not em.saving:  # no backward: neither the statistics nor a sum no one returns are written
            keep = [f"keep_sum={bool(meo)}"] if spec.ctx["writes_h"] else []
            block.add(Launch(f"{spec.name}_no_grad", args + keep, results))
            return em.table[stage.output].name
        # the fp32 statistics, one per row: values this lowering makes
        em.stats[norm.index] = [em.table.add(Role.STATISTIC, "float32", f"{norm.hint}_{stat}")
                                for stat in (["mean"] if spec.ctx["layernorm"] else []) + ["rstd"]]
        block.add(Launch(spec.name, args, results + em.stats[norm.index]))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        spec = em.kernel("backward", stage)
        norm, add, meo = norm_of(stage), stage.first("add_extra_input"), stage.first("make_extra_output")
        args = [dy, norm.input, *em.stats[norm.index]]
        args += _param_args(norm, ["weight"]) if "weight" in params_of(norm) else []  # gamma (L2 has none)
        args += [em.grad(meo.extra_out)] if meo else []
        results = [d_in] + [em.grad(norm.param(attr)) for attr in params_of(norm)]
        block.add(Launch(spec.name, args, results))
        _param_grads_shaped(em, norm, block)
        if add:
            em.grad_alias(block, em.grad(add.extra_in), d_in, "the residual's grad is the sum's grad")
        return d_in

    def saved_shapes(self, em, stage):
        return {em.table[stat].name: ("[rows]", em.table[stat].dtype) for stat in em.stats[norm_of(stage).index]}


NORM = NormStage()
