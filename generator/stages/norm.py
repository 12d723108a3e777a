"""Norm stages: LayerNorm / RMSNorm as a generated row kernel, with the residual stream fused in.

Forward: [AddExtraInput] [MakeExtraOutput] Norm. With the add, the kernel writes h = x + r (the
MakeExtraOutput's output, and the norm input saved for backward) and norm(h), saving fp32
mean/rstd. Backward: [AddExtraInput] [MakeExtraOutput] Norm: the dx kernel adds the extra output's
grad (the residual stream's), which is also AddExtraInput's grad, with deterministic dgamma/dbeta
partials summed by one column-sum kernel.
"""

from __future__ import annotations

from dataclasses import replace

from .. import kernels as kn
from ..kernels import KernelParam as P
from .base import Saves, StageImpl, extra_input_name, extra_output_name, param_name, value_name


def _norm_chain(chain) -> bool:
    """[add_extra_input] [make_extra_output] norm."""
    rest = list(chain)
    for optional in ("add_extra_input", "make_extra_output"):
        if rest[:1] == [optional]:
            rest.pop(0)
    return rest == ["norm"]


def norm_forward(stage) -> kn.KernelSpec:
    norm = stage.first("norm")
    residual = stage.first("add_extra_input") is not None
    layernorm = norm.opdef.name == "LayerNorm"
    return kn.make_spec(
        kn.kernel_name(("add_" if residual else "") + norm.tag, f"fwd_h{norm.in_features}"), "norm_fwd",
        ("residual add + " if residual else "") + norm.describe(kernel=True),
        abi=(P("x", "const T*"), P("residual", "const T*", residual), P("gamma", "const T*"),
             P("beta", "const T*", layernorm), P("y", "T*"), P("residual_out", "T*", residual),
             P("mean", "float*", layernorm), P("rstd", "float*"), P("rows", "int")),
        hidden=norm.in_features, align=norm.in_features, layernorm=layernorm,
        residual=residual, zero_centered_gamma=norm.args["zero_centered_gamma"], eps=norm.args["eps"],
        eps_literal=f"{norm.args['eps']!r}f", reference=norm.opdef.reference_names, geometry="row_threads",
    )


def _without_eps(norm):
    """The norm as its backward sees it: eps at its default. The backward kernel reads the saved
    rstd and never eps, so pipelines differing only in eps share one backward kernel."""
    default = next(a.default for a in norm.opdef.args if a.name == "eps")
    return replace(norm, args={**norm.args, "eps": default})


def norm_backward(stage) -> kn.KernelSpec:
    norm = _without_eps(stage.first("norm"))
    add_dresidual = stage.first("make_extra_output") is not None
    layernorm = norm.opdef.name == "LayerNorm"
    name = kn.kernel_name(norm.tag, f"bwd_h{norm.in_features}", "add_dresidual" if add_dresidual else "")
    return kn.make_spec(
        name, "norm_bwd", norm.describe(kernel=True) + (" backward, + residual grad" if add_dresidual else " backward"),
        abi=(P("dy", "const T*"), P("x", "const T*"), P("mean", "const float*", layernorm),
             P("rstd", "const float*"), P("gamma", "const T*"), P("dresidual", "const T*", add_dresidual),
             P("dx", "T*"), P("partials", "float*"), P("rows", "int")),
        hidden=norm.in_features, align=norm.in_features, layernorm=layernorm,
        add_dresidual=add_dresidual, zero_centered_gamma=norm.args["zero_centered_gamma"],
        grad_columns=norm.in_features * (2 if layernorm else 1),
        reference=norm.opdef.reference_names, geometry="row_threads",
    )


class NormStage(StageImpl):
    name = "norm"

    def check(self, pass_, chain):
        if _norm_chain(chain) and not (pass_ == "forward" and "make_extra_output" in chain
                                       and "add_extra_input" not in chain):
            return None
        what = "[AddExtraInput] [MakeExtraOutput] norm" if pass_ == "backward" else \
            "a norm, or AddExtraInput [MakeExtraOutput] norm"
        return f"a {pass_} norm stage runs only {what}"

    def materialises(self, stage):
        return {stage.start, stage.end, stage.first("norm").index}  # the (summed) norm input is written

    def saves(self, pipeline, stage, have):
        return Saves(values=frozenset({stage.first("norm").index}))

    def kernels(self, plan, stage, pass_):
        if pass_ == "forward":
            return [norm_forward(stage)]
        spec = norm_backward(stage)
        return [spec, kn.column_sum(spec.ctx["grad_columns"])]

    def forward(self, em, stage, block):
        p, spec = em.pipeline, em.kernel("forward", stage)
        x_in, out = em.values[stage.start], value_name(p, stage.end)
        norm, add, meo = stage.first("norm"), stage.first("add_extra_input"), stage.first("make_extra_output")
        layernorm = norm.opdef.name == "LayerNorm"
        args = [x_in] + ([extra_input_name(add)] if add else []) + [param_name(norm, "weight")]
        args += [param_name(norm, "bias")] if layernorm else []
        results = [out]
        if add:
            summed = extra_output_name(meo) if meo else value_name(p, norm.index)
            em.values[norm.index] = summed
            results.append(summed)
        if layernorm:
            results.append(f"{norm.hint}_mean")
        results.append(f"{norm.hint}_rstd")
        em.stats[norm.index] = results[1 + bool(add):]
        block.lines.append(f"{', '.join(results)} = kernels.{spec.name}({', '.join(args)})")
        return out

    def backward(self, em, stage, block, dy, d_in):
        spec = em.kernel("backward", stage)
        norm, add, meo = stage.first("norm"), stage.first("add_extra_input"), stage.first("make_extra_output")
        layernorm = norm.opdef.name == "LayerNorm"
        args = [dy, em.values[norm.index], *em.stats[norm.index], param_name(norm, "weight")]
        args += [f"d_{extra_output_name(meo)}"] if meo else []
        results = [d_in, f"d_{param_name(norm, 'weight')}"]
        results += [f"d_{param_name(norm, 'bias')}"] if layernorm else []
        block.lines.append(f"{', '.join(results)} = kernels.{spec.name}({', '.join(args)})")
        if add:
            block.lines.append(f"d_{extra_input_name(add)} = {d_in}  # the residual's grad is the sum's grad")
        return d_in

    def saved_names(self, em, stage):
        return em.stats[stage.first("norm").index]  # the forward's fp32 statistics


NORM = NormStage()
