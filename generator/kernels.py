"""Kernel specifications: what each fused stage of a plan needs compiled.

A ``KernelSpec`` is a function of the stage alone, so its name (which spells out the op chain,
the feature size and any non-default constant) is also its cache key: pipelines that share a
stage share the kernel. Each spec names the CUDA template that instantiates it and the launcher
family that calls it from Python; ``context`` fills both templates.

Names are bounded (``kernel_name``): one longer than ``MAX_KERNEL_NAME`` keeps a readable prefix
of its op chain, then ``x`` + a short hash of the full name, then its direction and size, so a
long elementwise run cannot push ``kernels/<name>_<dtype>.<arch>.cubin`` past file-name limits.
The full name is kept in ``KernelSpec.full_name`` (the .cu header comment and MANIFEST.json).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the stage implementations (stages/) call in here with these
    from .pipeline import Op, Pipeline
    from .plan import Plan, Stage

DTYPES = {"bfloat16": ("bf16", "__nv_bfloat16", 2), "float16": ("fp16", "__half", 2), "float32": ("fp32", "float", 4)}
ELEMENTWISE_THREADS = 128  # threads per block along the row; each thread moves 16-byte vectors
NORM_MAX_THREADS = 512  # threads per row of a norm kernel
# Longest kernel name, without the dtype suffix. Every name of the shipped specs but the long
# elementwise_chain run fits; with "_bf16.compute_80.ptx" a file name stays under 70 bytes.
MAX_KERNEL_NAME = 48
NAME_HASH_CHARS = 8  # hex digits of sha256(full name) in a cut name: "x" + 8 hex


def norm_threads(hidden: int, vec: int) -> int:
    """Threads per block of a norm kernel: a multiple of 32 covering the row's vectors, capped."""
    return min(NORM_MAX_THREADS, -(-hidden // vec // 32) * 32)


def kernel_name(chain: str, suffix: str, qualifier: str = "") -> tuple[str, str]:
    """(name, full name) of a kernel: ``<chain>_<suffix>[_<qualifier>]``, bounded.

    ``chain`` spells what the kernel computes (op tags, e.g. "bias_scale0p5_gelu"), ``suffix`` its
    direction and size ("fwd_n384", "bwd_h768", "n1024"), ``qualifier`` a variant ("from_bias",
    "add_dresidual"). A full name of at most MAX_KERNEL_NAME characters is the name. A longer one
    becomes ``<prefix>_x<hash>_<suffix>[_<qualifier>]``: the longest prefix of ``chain`` ending at
    a ``_`` that fits, then the first NAME_HASH_CHARS hex digits of sha256(full name), so the name
    is stable and (up to the hash) unique; the qualifier is dropped when even an empty prefix
    leaves no room for it (the hash still covers it)."""
    full = "_".join(part for part in (chain, suffix, qualifier) if part)
    if len(full) <= MAX_KERNEL_NAME:
        return full, full
    marker = "x" + hashlib.sha256(full.encode()).hexdigest()[:NAME_HASH_CHARS]
    tail = "_".join(part for part in (marker, suffix, qualifier) if part)
    if len(tail) > MAX_KERNEL_NAME:
        tail = f"{marker}_{suffix}"
    assert len(tail) <= MAX_KERNEL_NAME, f"kernel suffix {suffix!r} is too long for a bounded name"
    prefix = ""
    for part in chain.split("_"):
        longer = f"{prefix}_{part}" if prefix else part
        if len(longer) + 1 + len(tail) > MAX_KERNEL_NAME:
            break
        prefix = longer
    return (f"{prefix}_{tail}" if prefix else tail), full


@dataclass(frozen=True)
class KernelSpec:
    name: str  # without the dtype suffix, e.g. "bias_swiglu_bwd_n14336"; bounded (kernel_name)
    full_name: str  # the name before bounding; equal to ``name`` unless that was cut
    family: str  # norm_fwd | norm_bwd | column_sum | elementwise_fwd | elementwise_bwd
    context: tuple[tuple[str, object], ...]  # template variables, hashable and ordered
    summary: str

    @property
    def ctx(self) -> dict:
        ctx = dict(self.context)
        if "steps" in ctx:
            ctx["steps"] = [dict(step) for step in ctx["steps"]]
        return ctx

    def vec(self, itemsize: int) -> int:
        """Widest vector (at most 16 bytes) that divides every row this kernel touches."""
        v = 16 // itemsize
        while self.ctx["align"] % v:
            v //= 2
        return v


@dataclass(frozen=True)
class KernelParam:
    """One parameter of a kernel's C ABI. The ``.cu`` signature (templates/kernel_abi.j2) and the
    Python launch tuple (templates/kernels.py.j2) are both rendered from ``kernel_abi``."""

    name: str  # the .cu parameter, and the launcher's local variable that holds it
    ctype: str  # "const T*", "T*", "const float*", "float*" or "int" (T: the kernel's dtype)
    passed: bool = True  # False: this specialisation passes a null pointer, which the kernel ignores


def kernel_abi(spec: KernelSpec) -> tuple[KernelParam, ...]:
    """The parameters of ``spec``'s kernel, in order: the one source of its ABI."""
    c, P = spec.ctx, KernelParam
    if spec.family == "norm_fwd":
        return (P("x", "const T*"), P("residual", "const T*", c["residual"]), P("gamma", "const T*"),
                P("beta", "const T*", c["layernorm"]), P("y", "T*"), P("residual_out", "T*", c["residual"]),
                P("mean", "float*", c["layernorm"]), P("rstd", "float*"), P("rows", "int"))
    if spec.family == "norm_bwd":
        return (P("dy", "const T*"), P("x", "const T*"), P("mean", "const float*", c["layernorm"]),
                P("rstd", "const float*"), P("gamma", "const T*"), P("dresidual", "const T*", c["add_dresidual"]),
                P("dx", "T*"), P("partials", "float*"), P("rows", "int"))
    if spec.family == "column_sum":
        return P("partials", "const float*"), P("out", "T*"), P("splits", "int")
    io = launcher_io(spec)
    first, last = ("x", ("y",)) if spec.family == "elementwise_fwd" else ("dy", ())
    partials = ("partials",) if c.get("bias_columns") else ()
    return (P(first, "const T*"), *(P(o, "const T*") for o in io["operands"]),
            *(P(w, "T*") for w in (*io["written"], *last)), *(P(n, "float*") for n in partials), P("rows", "int"))


def _spec(name: tuple[str, str], family: str, summary: str, **context) -> KernelSpec:
    """A spec named by ``kernel_name``'s (name, full name)."""
    return KernelSpec(*name, family, tuple(sorted(context.items())), summary)


def column_sum(columns: int) -> KernelSpec:
    return _spec(kernel_name("column_sum", f"n{columns}"), "column_sum",
                 f"sums fp32 per-block partials over blocks, {columns} columns", columns=columns, align=1)


# --- norms --------------------------------------------------------------------------------------

def norm_forward(stage: Stage) -> KernelSpec:
    norm = stage.first("norm")
    residual = stage.first("add_extra_input") is not None
    name = kernel_name(("add_" if residual else "") + norm.tag, f"fwd_h{norm.in_features}")
    return _spec(
        name, "norm_fwd", ("residual add + " if residual else "") + norm.describe(),
        hidden=norm.in_features, align=norm.in_features, layernorm=norm.opdef.name == "LayerNorm",
        residual=residual, zero_centered_gamma=norm.args["zero_centered_gamma"], eps=norm.args["eps"],
        reference=norm.opdef.reference_names,
    )


def _without_eps(norm: Op) -> Op:
    """The norm as its backward sees it: eps at its default. The backward kernel reads the saved
    rstd and never eps, so pipelines differing only in eps share one backward kernel."""
    default = next(a.default for a in norm.opdef.args if a.name == "eps")
    return replace(norm, args={**norm.args, "eps": default})


def norm_backward(stage: Stage) -> KernelSpec:
    norm = _without_eps(stage.first("norm"))
    add_dresidual = stage.first("make_extra_output") is not None
    name = kernel_name(norm.tag, f"bwd_h{norm.in_features}", "add_dresidual" if add_dresidual else "")
    return _spec(
        name, "norm_bwd", norm.describe() + (" backward, + residual grad" if add_dresidual else " backward"),
        hidden=norm.in_features, align=norm.in_features, layernorm=norm.opdef.name == "LayerNorm",
        add_dresidual=add_dresidual, zero_centered_gamma=norm.args["zero_centered_gamma"],
        grad_columns=norm.in_features * (2 if norm.opdef.name == "LayerNorm" else 1),
        reference=norm.opdef.reference_names,
    )


# --- elementwise runs ---------------------------------------------------------------------------

def _glu_index(ops: tuple[Op, ...]) -> int | None:
    return next((op.index for op in ops if op.kind == "glu"), None)


def _step(stage: Stage, op: Op, glu: int | None, **extra) -> tuple[tuple[str, object], ...]:
    """One op of a run as the templates see it: its index within the run, lanes 'a' (and 'b'
    before a GLU, for the second half of the row)."""
    lanes = ("a", "b") if glu is not None and op.index <= glu else ("a",)  # a GLU reads both halves
    constants = op.opdef.device_args(op.args)
    step = dict(kind=op.kind, index=op.index - stage.start, lanes=lanes, form=op.opdef.functor_form,
                struct=op.opdef.device_struct, cuda_args=tuple(f"{float(c)!r}f" for c in constants),
                python_args=tuple(repr(float(c)) for c in constants), label=op.describe(),
                reference=op.opdef.reference_names, **extra)
    return tuple(sorted(step.items()))


def _alias(stage: Stage, op: Op, changes: str, first: str, last: str) -> str:
    """Where an extra tensor of ``op`` comes from: the run's ``first`` tensor when no op before it
    changes ``changes`` (value or grad), its ``last`` tensor when none after does, else 'write'."""
    before = any(getattr(o.opdef, changes) for o in stage.ops if o.index < op.index)
    after = any(getattr(o.opdef, changes) for o in stage.ops if o.index > op.index)
    return first if not before else last if not after else "write"


def forward_aliases(stage: Stage) -> dict[int, str]:
    """For each MakeExtraOutput in a forward run: 'input', 'output' (the same tensor) or 'write'."""
    return {op.index: _alias(stage, op, "changes_value", "input", "output")
            for op in stage.ops if op.kind == "make_extra_output"}


def backward_aliases(stage: Stage) -> dict[int, str]:
    """For each AddExtraInput in a backward run, its grad: 'dx', 'dy' (the same tensor) or 'write'."""
    return {op.index: _alias(stage, op, "changes_grad", "dx", "dy")
            for op in stage.ops if op.kind == "add_extra_input"}


def elementwise_forward(pipeline: Pipeline, stage: Stage) -> KernelSpec:
    glu = _glu_index(stage.ops)
    aliases = forward_aliases(stage)
    width = pipeline.width(stage.end)
    steps = tuple(_step(stage, op, glu, write=aliases.get(op.index) == "write") for op in stage.ops)
    tags = "_".join(op.tag for op in stage.ops)
    return _spec(
        kernel_name(tags, f"fwd_n{width}"), "elementwise_fwd", ", ".join(op.describe() for op in stage.ops),
        width=width, in_width=pipeline.width(stage.start), glu=glu is not None, steps=steps, align=width,
        threads=ELEMENTWISE_THREADS,
    )


def elementwise_backward(plan: Plan, stage: Stage) -> KernelSpec:
    pipeline = plan.pipeline
    glu = _glu_index(stage.ops)
    aliases = backward_aliases(stage)
    recompute = plan.recompute.get(stage.start)
    width = pipeline.width(stage.end)
    steps, bias_columns = [], 0
    for op in stage.ops:
        steps.append(_step(
            stage, op, glu, write=aliases.get(op.index) == "write", bias_offset=bias_columns,
            recompute=recompute is not None and recompute.saved_position <= op.index <= recompute.last,
            apply=recompute is not None and recompute.saved_position <= op.index < recompute.last,
            needs_input=op.opdef.needs_input_in_backward,
        ))
        bias_columns += op.in_features if op.kind == "bias" else 0
    first_needing = next((op.index for op in stage.ops if op.opdef.needs_input_in_backward), None)
    qualifier = ""
    if recompute is not None and recompute.saved_position != first_needing:
        qualifier = f"from_{pipeline.ops[recompute.saved_position].tag}"
    name = kernel_name("_".join(op.tag for op in stage.ops), f"bwd_n{width}", qualifier)
    return _spec(
        name, "elementwise_bwd", ", ".join(op.describe() for op in stage.ops) + " backward",
        width=width, in_width=pipeline.width(stage.start), glu=glu is not None, steps=tuple(steps), align=width,
        threads=ELEMENTWISE_THREADS, writes_dx=any(op.opdef.changes_grad for op in stage.ops),
        saved_offset=None if recompute is None else recompute.saved_position - stage.start,
        saved_two_lanes=recompute is not None and glu is not None and recompute.saved_position <= glu,
        bias_columns=bias_columns,
    )


def stage_kernels(plan: Plan) -> dict[tuple[str, int], list[KernelSpec]]:
    """Kernels per stage that has any, keyed by (pass, stage start); the stage's main kernel first."""
    out: dict[tuple[str, int], list[KernelSpec]] = {}
    for pass_, stages in (("forward", plan.forward), ("backward", plan.backward)):
        for stage in stages:
            specs = stage.rule.stage.kernels(plan, stage, pass_)
            if specs:
                out[(pass_, stage.start)] = specs
    return out


def launcher_io(spec: KernelSpec) -> dict[str, list[str]]:
    """Names of an elementwise launcher's tensor operands (after x or dy), written outputs, results."""
    steps = spec.ctx.get("steps", [])
    if spec.family == "elementwise_fwd":
        operands = [f"bias{s['index']}" if s["kind"] == "bias" else f"extra_in{s['index']}"
                    for s in steps if s["kind"] in ("bias", "add_extra_input")]
        written = [f"extra_out{s['index']}" for s in steps if s["kind"] == "make_extra_output" and s["write"]]
        return dict(operands=operands, written=written, returned=["y", *written])
    if spec.family == "elementwise_bwd":
        operands = ["x"] if spec.ctx["saved_offset"] is not None else []
        for s in steps:
            if s["recompute"] and s["kind"] == "bias":
                operands.append(f"bias{s['index']}")
            elif s["recompute"] and s["kind"] == "add_extra_input":
                operands.append(f"extra_in{s['index']}")
            elif s["kind"] == "make_extra_output":
                operands.append(f"d_extra_out{s['index']}")
        written = (["dx"] if spec.ctx["writes_dx"] else []) + [
            f"d_extra_in{s['index']}" for s in steps if s["kind"] == "add_extra_input" and s["write"]]
        dbias = [f"dbias{s['index']}" for s in steps if s["kind"] == "bias"]
        return dict(operands=operands, written=written, returned=written + dbias)
    return dict(operands=[], written=[], returned=[])
