"""The one ordered list of fusion rules for each pass.

Rules are tried in this order; each slides greedily left to right over the ops that earlier rules
left unfused (TE's op fuser works the same way). A forward rule marked ``inference_only`` applies
only to the no-grad forward (plan.py). Patterns are written in forward op order for both
passes. To add a rule: one file named after the op chain it matches, then one line here.
"""

from .add_norm import FORWARD_ADD_NORM
from .attention import BACKWARD_ATTENTION, FORWARD_ATTENTION
from .collective import BACKWARD_COLLECTIVE, FORWARD_COLLECTIVE
from .collective_gemm import (BACKWARD_ALL_GATHER_LINEAR, BACKWARD_LINEAR_REDUCE_SCATTER, FORWARD_ALL_GATHER_LINEAR,
                              FORWARD_LINEAR_REDUCE_SCATTER)
from .dropout_norm import FORWARD_DROPOUT_ADD_NORM, FORWARD_NORM_DROPOUT
from .elementwise import BACKWARD_ELEMENTWISE, FORWARD_ELEMENTWISE
from .extra_output_linear import BACKWARD_EXTRA_OUTPUT_LINEAR
from .l2_normalization import BACKWARD_L2_NORMALIZATION, FORWARD_L2_NORMALIZATION
from .linear import BACKWARD_LINEAR, FORWARD_LINEAR
from .linear_bias import FORWARD_LINEAR_BIAS
from .linear_epilogue import (BACKWARD_LINEAR_SCALE, FORWARD_LINEAR_BIAS_GELU, FORWARD_LINEAR_BIAS_RELU,
                              FORWARD_LINEAR_BIAS_SCALE, FORWARD_LINEAR_SCALE_ADD)
from .norm import BACKWARD_NORM, FORWARD_NORM
from .norm_residual_grad import BACKWARD_NORM_RESIDUAL_GRAD
from .module import BACKWARD_MODULE, FORWARD_MODULE
from .opaque import BACKWARD_OPAQUE, FORWARD_OPAQUE
from .reshape import BACKWARD_RESHAPE, FORWARD_RESHAPE

FORWARD_RULES = (
    FORWARD_DROPOUT_ADD_NORM,  # [Bias] Dropout [AddExtraInput] [MakeExtraOutput] Norm [Dropout]: one kernel
    FORWARD_NORM_DROPOUT,  # [AddExtraInput] [MakeExtraOutput] Norm Dropout: one kernel
    FORWARD_ADD_NORM,  # AddExtraInput [MakeExtraOutput] Norm: residual add + norm in one kernel
    FORWARD_NORM,  # Norm
    FORWARD_L2_NORMALIZATION,  # L2Normalization at a fixed width: the norm kernel
    FORWARD_ALL_GATHER_LINEAR,  # AllGather BasicLinear: one call, micro-pipelined (symmetric memory)
    FORWARD_LINEAR_REDUCE_SCATTER,  # BasicLinear ReduceScatter: one call, micro-pipelined (symmetric memory)
    FORWARD_LINEAR_BIAS_RELU,  # BasicLinear Bias ReLU: cuBLASLt's bias + ReLU epilogue
    FORWARD_LINEAR_BIAS_GELU,  # BasicLinear Bias GELU, without grad only: cuBLASLt's bias + GELU epilogue
    FORWARD_LINEAR_SCALE_ADD,  # BasicLinear [ConstantScale] AddExtraInput: GEMM alpha, accumulating (beta=1)
    FORWARD_LINEAR_BIAS_SCALE,  # BasicLinear [Bias] ConstantScale: GEMM alpha (and beta)
    FORWARD_LINEAR_BIAS,  # BasicLinear Bias: one GEMM with the bias in its epilogue
    FORWARD_LINEAR,  # BasicLinear: one GEMM
    FORWARD_ELEMENTWISE,  # a maximal run of elementwise ops: one kernel
    FORWARD_ATTENTION,  # a self-attention op: FlashAttention-2 varlen (torch), the reference math off it
    FORWARD_OPAQUE,  # an op registered opaque: its reference math in PyTorch
    FORWARD_RESHAPE,  # Reshape: a view, no kernel
    FORWARD_MODULE,  # a module of the user's code: run as it is
    FORWARD_COLLECTIVE,  # AllGather, ReduceScatter, AllReduce (a TP Linear's too): torch.distributed
)

BACKWARD_RULES = (
    BACKWARD_NORM_RESIDUAL_GRAD,  # [AddExtraInput] [MakeExtraOutput] Norm: residual grad add in norm dx
    BACKWARD_NORM,  # Norm
    BACKWARD_L2_NORMALIZATION,  # L2Normalization at a fixed width: the norm dx kernel
    BACKWARD_ALL_GATHER_LINEAR,  # AllGather BasicLinear: the dgrad GEMM and its reduce-scatter micro-pipelined
    BACKWARD_LINEAR_REDUCE_SCATTER,  # BasicLinear ReduceScatter: dy's all-gather and the dgrad GEMM micro-pipelined
    BACKWARD_EXTRA_OUTPUT_LINEAR,  # MakeExtraOutput BasicLinear: dgrad GEMM accumulates (beta=1)
    BACKWARD_LINEAR_SCALE,  # BasicLinear ConstantScale: the scale as the GEMMs' alpha
    BACKWARD_LINEAR,  # BasicLinear: dgrad and wgrad GEMMs
    BACKWARD_ELEMENTWISE,  # a maximal run of elementwise ops: one kernel, dbias fused
    BACKWARD_ATTENTION,  # a self-attention op: FlashAttention-2 varlen backward (torch)
    BACKWARD_OPAQUE,  # an op registered opaque: its reference backward in PyTorch
    BACKWARD_RESHAPE,  # Reshape: the grad viewed back, no kernel
    BACKWARD_MODULE,  # a module of the user's code: its own backward
    BACKWARD_COLLECTIVE,  # a collective: its pair through autograd
)

__all__ = ["FORWARD_RULES", "BACKWARD_RULES"]
