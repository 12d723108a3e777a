"""GEMM stages: BasicLinear through cuBLAS via torch, with what its epilogue can absorb.

Forward y = x W^T, with a following Bias in the epilogue (``torch.addmm``). Backward dgrad dy W and
wgrad dy^T x; a MakeExtraOutput just before the linear has its output grad accumulated into dgrad
(``beta=1``, TE's BackwardLinearAdd). Nothing else fits a GEMM call, so ``check`` refuses any
other chain: a rule asking for, say, a scale in the epilogue fails when it is defined.
"""

from __future__ import annotations

from .base import Saves, StageImpl, extra_output_name, param_name, value_name

FORMS = {
    "forward": {("linear",): "GEMM", ("linear", "bias"): "GEMM with the bias in its epilogue"},
    "backward": {("linear",): "dgrad and wgrad GEMMs",
                 ("make_extra_output", "linear"): "dgrad accumulating the extra output's grad"},
}


class GemmStage(StageImpl):
    name = "gemm"

    def check(self, pass_, chain):
        if tuple(chain) in FORMS[pass_]:
            return None
        can = "; ".join(" + ".join(form) for form in FORMS[pass_])
        return f"a {pass_} GEMM stage runs only these op chains: {can}"

    def saves(self, pipeline, stage, have):
        return Saves(values=frozenset({stage.first("linear").index}))  # wgrad reads the GEMM input

    def runs_as(self, pass_, stage, kernels):
        return "cuBLAS GEMM (torch)" if pass_ == "forward" else "cuBLAS dgrad + wgrad GEMMs (torch)"

    def forward(self, em, stage, block):
        linear, bias = stage.first("linear"), stage.first("bias")
        x_in, out = em.values[stage.start], value_name(em.pipeline, stage.end)
        w = param_name(linear, "weight")
        if bias is not None:
            block.lines.append(f"{out} = torch.addmm({param_name(bias, 'bias')}, {x_in}, {w}.t())")
        else:
            block.lines.append(f"{out} = {x_in}.mm({w}.t())")
        return out

    def backward(self, em, stage, block, dy, d_in):
        linear, meo = stage.first("linear"), stage.first("make_extra_output")
        w = param_name(linear, "weight")
        if meo is not None:
            block.lines.append(f"{d_in} = torch.addmm(d_{extra_output_name(meo)}, {dy}, {w})")
        else:
            block.lines.append(f"{d_in} = {dy}.mm({w})")
        if linear.args["accumulate_into_main_grad"]:  # TE's option: dW goes into weight.main_grad
            block.lines.append(f"d_{w} = ref.accumulate_into_main_grad({w}, {dy}, {em.values[linear.index]})")
        else:
            block.lines.append(f"d_{w} = {dy}.t().mm({em.values[linear.index]})")
        return d_in


GEMM = GemmStage()
