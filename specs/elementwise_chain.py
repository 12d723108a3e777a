"""Every op kind of the catalog in one pipeline, so each fusion path is generated and tested:
ReLU on the input (where its kink sees exact values, so low-precision tests stay meaningful); a
residual add fused into a zero-centered LayerNorm with the sum as an extra output; an elementwise
run with a bias the GEMM cannot take, ConstantScale, GELU, an extra output and an extra input
mid-run, SiLU, Identity, GEGLU halving the width, another residual and SiLU; a GEMM without bias;
RMSNorm and SwiGLU."""

from fusegen.eager import (
    AddExtraInput,
    BasicLinear,
    Bias,
    ConstantScale,
    GEGLU,
    GELU,
    Identity,
    LayerNorm,
    MakeExtraOutput,
    ReLU,
    RMSNorm,
    Sequential,
    SiLU,
    SwiGLU,
)

H = 768

elementwise_chain = Sequential(
    ReLU(),
    AddExtraInput(),
    MakeExtraOutput(),
    LayerNorm(H, eps=1e-6, zero_centered_gamma=True),
    Bias(H),
    ConstantScale(0.5),
    GELU(),
    MakeExtraOutput(),
    AddExtraInput(),
    SiLU(),
    Identity(),
    Bias(H),
    GEGLU(),
    AddExtraInput(),
    SiLU(),
    BasicLinear(H // 2, H),
    RMSNorm(H, zero_centered_gamma=True),
    SwiGLU(),
)
