"""Norm stages: LayerNorm / RMSNorm as a generated row kernel, with what comes before it fused in.

Forward: [prologue] [AddExtraInput] [MakeExtraOutput] Norm. The prologue is elementwise ops on the
input (Bias, Dropout, ConstantScale: "bias, dropout, add" then the norm), applied as each vector
is loaded, with the same functors as an elementwise kernel's. With a prologue or the add, the
kernel writes h = prologue(x) [+ r] (the MakeExtraOutput's output, and the norm input saved for
backward) and norm(h), saving fp32 mean/rstd. Backward: [AddExtraInput] [MakeExtraOutput] Norm:
the dx kernel adds the extra output's grad (the residual stream's), which is also AddExtraInput's
grad, with deterministic dgamma/dbeta partials, which the kernel adds itself at a few rows (one
cooperative launch, kernels.SUMS_IN_KERNEL_SPLITS), else one column-sum kernel; a prologue's ops
are an elementwise backward stage of their own.
"""

from __future__ import annotations

from dataclasses import replace

from .. import kernels as kn
from ..kernels import KernelParam as P
from ..ops import OPS
from . import elementwise as ew
from ..calls import Expr, Launch, TorchCall, literal
from ..values import Role
from .base import RowTraffic, Saves, StageImpl, extra_input_name, extra_output_name, fixed, param_name


NORM_KINDS = ("norm", "l2_normalization")  # LayerNorm, RMSNorm; L2Normalization (no gamma, a sum)


def norm_of(stage):
    """The stage's norm op."""
    return next(op for op in stage.ops if op.kind in NORM_KINDS)


def _params(norm) -> list[str]:
    """The norm's parameters: weight (gamma) and, for LayerNorm, bias (beta); none for L2."""
    return [p.name for p in norm.opdef.params]


def _param_args(norm, attrs) -> list:
    """The norm's parameters as its kernels take them: one row of features, a parameter of a
    multi-dim normalized_shape viewed flat (its memory is that row)."""
    shapes = {attr: shape for attr, _, shape, _ in norm.params}
    return [Expr("{p}.view(-1)", p=norm.param(a)) if len(shapes[a]) > 1 else norm.param(a) for a in attrs]


def _param_grads_shaped(norm, block) -> None:
    """The calls that give a multi-dim norm's parameter grads their parameter's shape back."""
    for attr, _, shape, _ in norm.params:
        if len(shape) > 1:
            grad = literal(f"d_{param_name(norm, attr)}")
            block.add(TorchCall(f"{grad} = {grad}.view{literal(repr(tuple(shape)))}"))


def _kernel_reference(norm) -> tuple[str, str]:
    """The reference functions the CPU launchers call, in the kernels' form (statistics out and
    in): the op's own for LayerNorm and RMSNorm; L2Normalization's own are the opaque stage's (y
    only), so its kernel form is a pair of its reference helpers (ops/norms.py)."""
    if norm.kind == "l2_normalization":
        return ("l2_norm_rows", "l2_norm_rows_bwd")
    return norm.opdef.reference_names


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


def _sides(stage):
    """The stage's ops before its AddExtraInput / MakeExtraOutput / norm, and after its norm."""
    at = norm_of(stage).index
    middle = ("add_extra_input", "make_extra_output", *NORM_KINDS)
    return ([op for op in stage.ops if op.index < at and op.kind not in middle],
            [op for op in stage.ops if op.index > at])


def _kernel_ops(stage) -> list:
    """The ops the forward kernel applies, in order, which number its operands: the ops before,
    the norm, the ops after. An AddExtraInput or MakeExtraOutput only sets whether the kernel reads
    a residual or writes the sum (its name says the first; the second changes no code), so
    [MakeExtraOutput] RMSNorm Dropout and RMSNorm Dropout are one kernel under one name."""
    before, after = _sides(stage)
    return [*before, norm_of(stage), *after]


def norm_forward(stage) -> kn.KernelSpec:
    norm = norm_of(stage)
    residual = stage.first("add_extra_input") is not None
    before, after = _sides(stage)
    kernel_ops = _kernel_ops(stage)
    prologue = tuple(ew.op_step(stage, op, None, kernel_ops, write=False) for op in before)
    epilogue = tuple(ew.op_step(stage, op, None, kernel_ops, write=False) for op in after)
    ctypes = ew.operand_ctypes(prologue + epilogue)
    members = [[(ctypes[dict(s)["operand"]], dict(s)["operand"]) for s in steps if dict(s)["operand"]]
               for steps in (prologue, epilogue)]
    operands = [name for _, name in members[0] + members[1]]
    writes_h = residual or bool(before)  # the norm's input differs from x: it is written
    layernorm, l2 = norm.opdef.name == "LayerNorm", norm.kind == "l2_normalization"
    chain = "_".join([op.tag for op in before] + (["add"] if residual else []) + [norm.tag] + [op.tag for op in after])
    summary = [op.describe(kernel=True) for op in before] + (["residual add"] if residual else [])
    summary += [norm.describe(kernel=True)] + [op.describe(kernel=True) for op in after]
    return kn.make_spec(
        kn.kernel_name(chain, f"fwd_h{norm.in_features}"), "norm_fwd", " + ".join(summary),
        abi=(P("x", "const T*"), *(P(o, ctypes[o]) for o in operands), P("residual", "const T*", residual),
             P("gamma", "const T*", not l2), P("beta", "const T*", layernorm), P("y", "T*"),
             P("residual_out", "T*", writes_h), P("mean", "float*", layernorm), P("rstd", "float*"), P("rows", "int")),
        operands=operands, headers=("norm.cuh", *(ew.device_headers(stage) if before or after else ())),
        hidden=norm.in_features, align=norm.in_features, layernorm=layernorm, l2=l2, residual=residual,
        writes_h=writes_h, prologue=prologue, epilogue=epilogue, steps=prologue + epilogue,
        prologue_members=tuple(members[0]), epilogue_members=tuple(members[1]),
        zero_centered_gamma=norm.args.get("zero_centered_gamma", False), eps=norm.args["eps"],
        eps_literal=f"{norm.args['eps']!r}f", reference=_kernel_reference(norm), geometry="row_threads",
    )


def _without_eps(norm):
    """The norm as its backward sees it: eps at its default. The backward kernel reads the saved
    rstd and never eps, so pipelines differing only in eps share one backward kernel."""
    default = next(a.default for a in norm.opdef.args if a.name == "eps")
    return replace(norm, args={**norm.args, "eps": default})


def norm_backward(stage) -> kn.KernelSpec:
    norm = _without_eps(norm_of(stage))
    add_dresidual = stage.first("make_extra_output") is not None
    layernorm, l2 = norm.opdef.name == "LayerNorm", norm.kind == "l2_normalization"
    name = kn.kernel_name(norm.tag, f"bwd_h{norm.in_features}", "add_dresidual" if add_dresidual else "")
    grad_columns = norm.in_features * len(_params(norm))
    return kn.make_spec(
        name, "norm_bwd", norm.describe(kernel=True) + (" backward, + residual grad" if add_dresidual else " backward"),
        headers=("norm.cuh",),
        abi=(P("dy", "const T*"), P("x", "const T*"), P("mean", "const float*", layernorm),
             P("rstd", "const float*"), P("gamma", "const T*", not l2), P("dresidual", "const T*", add_dresidual),
             P("dx", "T*"), P("partials", "float*", not l2), P("grads", "T*", not l2), P("rows", "int")),
        hidden=norm.in_features, align=norm.in_features, layernorm=layernorm, l2=l2,
        add_dresidual=add_dresidual, zero_centered_gamma=norm.args.get("zero_centered_gamma", False),
        grad_columns=grad_columns,  # dgamma (and dbeta) partials
        single_launch=not l2,  # at a few rows the kernel adds them itself (kernels.SUMS_IN_KERNEL_SPLITS)
        shared_partials=kn.norm_bwd_shared_partials(grad_columns),
        reference=_kernel_reference(norm), geometry="row_threads",
    )


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
        if pass_ == "forward":
            return [norm_forward(stage)]
        spec = norm_backward(stage)
        return [spec, kn.column_sum(spec.ctx["grad_columns"])] if spec.ctx["grad_columns"] else [spec]

    def row_traffic(self, plan, pass_, stage):
        norm, meo = norm_of(stage), stage.first("make_extra_output")
        h = norm.in_features
        if not fixed(h):
            return None
        spec = norm_backward(stage) if pass_ == "backward" else norm_forward(stage)
        stats = 2 if spec.ctx["layernorm"] else 1  # mean and rstd, or rstd
        if pass_ == "backward":  # dy, the saved sum, the statistics (+ the extra output's grad) -> dx
            return RowTraffic(3 * h + (h if meo else 0), stats)
        kernel_ops = _kernel_ops(stage)
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
        operands = ew.io_names(stage, _kernel_ops(stage))
        args = [stage.input] + [operands[o] for o in spec.operands] + ([add.extra_in] if add else [])
        args += _param_args(norm, _params(norm))
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
        args += _param_args(norm, ["weight"]) if "weight" in _params(norm) else []  # gamma (L2 has none)
        args += [f"d_{extra_output_name(meo)}"] if meo else []
        results = [d_in] + [f"d_{param_name(norm, attr)}" for attr in _params(norm)]
        block.add(Launch(spec.name, args, results))
        _param_grads_shaped(norm, block)
        if add:
            em.grad_alias(block, f"d_{extra_input_name(add)}", d_in, "the residual's grad is the sum's grad")
        return d_in

    def saved_shapes(self, em, stage):
        return {em.table[stat].name: ("[rows]", em.table[stat].dtype) for stat in em.stats[norm_of(stage).index]}


NORM = NormStage()
