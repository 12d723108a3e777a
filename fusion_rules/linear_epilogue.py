"""Forward: BasicLinear followed by what cuBLAS's epilogue can take, as one GEMM (torch.addmm,
y = beta C + alpha x W^T): a Bias and a ReLU (torch._addmm_activation: cuBLASLt's bias + ReLU
epilogue; the ReLU's backward reads its output), a ConstantScale as alpha, after a Bias too
(alpha = beta = s); an
AddExtraInput as C with beta = 1, the GEMM accumulating into the residual (TE's
ForwardLinearBiasAdd / ForwardLinearScaleAdd), after a ConstantScale too.
Backward: BasicLinear, ConstantScale → the scale as the dgrad and wgrad GEMMs' alpha (TE's
BackwardLinearScale).
No-grad forward only: a Bias and a GELU in cuBLASLt's bias + GELU epilogue (TE's
ForwardLinearBiasActivation names it but never forms it); with autograd on, the GELU's backward
needs the pre-activation the epilogue does not keep, so the GELU stays in its own kernel."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import GEMM

FORWARD_LINEAR_BIAS_RELU = Rule(
    name="linear_bias_relu", pass_=FORWARD, stage=GEMM,
    doc="GEMM with the bias and the ReLU in its epilogue (cuBLASLt)", pattern=("linear", "bias", "relu"),
)
FORWARD_LINEAR_BIAS_GELU = Rule(
    name="linear_bias_gelu", pass_=FORWARD, stage=GEMM, inference_only=True,
    doc="GEMM with the bias and the GELU in its epilogue (cuBLASLt), without grad only", pattern=("linear", "bias", "gelu"),
)
FORWARD_LINEAR_SCALE_ADD = Rule(
    name="linear_scale_add", pass_=FORWARD, stage=GEMM,
    doc="GEMM with the scale as alpha, accumulating into the extra input (beta=1)",
    pattern=("linear", "scale?", "add_extra_input"),
)
FORWARD_LINEAR_BIAS_SCALE = Rule(
    name="linear_bias_scale", pass_=FORWARD, stage=GEMM,
    doc="GEMM with the bias in its epilogue, scaled by alpha = beta = s",
    pattern=("linear", "bias?", "scale"),
)
BACKWARD_LINEAR_SCALE = Rule(
    name="linear_scale_backward", pass_=BACKWARD, stage=GEMM,
    doc="dgrad and wgrad GEMMs with the scale as alpha", pattern=("linear", "scale"),
)
