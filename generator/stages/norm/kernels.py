"""The norm kernels' specs: a forward (its ops before and after the norm fused in) and a
backward, built from a norm stage's ops. What the kernels compute is templates/cuda/norm.cuh and
templates/norm/; how they launch, stages/norm/family.py; their tuning, tuning.py."""

from __future__ import annotations

from dataclasses import replace

from ... import kernels as kn
from ...kernels import KernelParam as P
from ..elementwise import steps as ew
from .tuning import norm_bwd_shared_partials

NORM_KINDS = ("norm", "l2_normalization")  # LayerNorm, RMSNorm; L2Normalization (no gamma, a sum)


def norm_of(stage):
    """The stage's norm op."""
    return next(op for op in stage.ops if op.kind in NORM_KINDS)


def params_of(norm) -> list[str]:
    """The norm's parameters: weight (gamma) and, for LayerNorm, bias (beta); none for L2."""
    return [p.name for p in norm.opdef.params]


def _kernel_reference(norm) -> tuple[str, str]:
    """The reference functions the CPU launchers call, in the kernels' form (statistics out and
    in): the op's own for LayerNorm and RMSNorm; L2Normalization's own are the opaque stage's (y
    only), so its kernel form is a pair of its reference helpers (ops/norms.py)."""
    if norm.kind == "l2_normalization":
        return ("l2_norm_rows", "l2_norm_rows_bwd")
    return norm.opdef.reference_names


def _sides(stage):
    """The stage's ops before its AddExtraInput / MakeExtraOutput / norm, and after its norm."""
    at = norm_of(stage).index
    middle = ("add_extra_input", "make_extra_output", *NORM_KINDS)
    return ([op for op in stage.ops if op.index < at and op.kind not in middle],
            [op for op in stage.ops if op.index > at])


def kernel_ops_of(stage) -> list:
    """The ops the forward kernel applies, in order, which number its operands: the ops before,
    the norm, the ops after. An AddExtraInput or MakeExtraOutput only sets whether the kernel reads
    a residual or writes the sum (its name says the first; the second changes no code), so
    [MakeExtraOutput] RMSNorm Dropout and RMSNorm Dropout are one kernel under one name."""
    before, after = _sides(stage)
    return [*before, norm_of(stage), *after]


def norm_forward(stage, amax: bool = False) -> kn.KernelSpec:
    """The stage's forward kernel; with ``amax``, the variant that also keeps its output's amax
    (an FP8 GEMM casts the output: current scaling's cast then needs no amax pass over it)."""
    norm = norm_of(stage)
    residual = stage.first("add_extra_input") is not None
    before, after = _sides(stage)
    kernel_ops = kernel_ops_of(stage)
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
    extra = dict(amax=True) if amax else {}  # (a plain kernel's context as before: its name and sources)
    return kn.make_spec(
        kn.kernel_name(chain, f"fwd_h{norm.in_features}" + ("_amax" if amax else "")), "norm_fwd",
        " + ".join(summary) + (", its amax" if amax else ""),
        abi=(P("x", "const T*"), *(P(o, ctypes[o]) for o in operands), P("residual", "const T*", residual),
             P("gamma", "const T*", not l2), P("beta", "const T*", layernorm), P("y", "T*"),
             P("residual_out", "T*", writes_h), P("mean", "float*", layernorm), P("rstd", "float*"),
             *((P("amax", "float*"),) if amax else ()), P("rows", "int")),
        operands=operands, headers=("norm.cuh", *(ew.device_headers(stage) if before or after else ())), **extra,
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
    grad_columns = norm.in_features * len(params_of(norm))
    return kn.make_spec(
        name, "norm_bwd", norm.describe(kernel=True) + (" backward, + residual grad" if add_dresidual else " backward"),
        headers=("norm.cuh",),
        abi=(P("dy", "const T*"), P("x", "const T*"), P("mean", "const float*", layernorm),
             P("rstd", "const float*"), P("gamma", "const T*", not l2), P("dresidual", "const T*", add_dresidual),
             P("dx", "T*"), P("partials", "float*", not l2), P("grads", "T*", not l2), P("rows", "int")),
        hidden=norm.in_features, align=norm.in_features, layernorm=layernorm, l2=l2,
        add_dresidual=add_dresidual, zero_centered_gamma=norm.args.get("zero_centered_gamma", False),
        grad_columns=grad_columns,  # dgamma (and dbeta) partials
        single_launch=not l2,  # at a few rows the kernel adds them itself (tuning.SUMS_IN_KERNEL_SPLITS)
        shared_partials=norm_bwd_shared_partials(grad_columns),
        reference=_kernel_reference(norm), geometry="row_threads",
    )
