"""Issue 41's benchmark block: the Llama MLP block at hidden 8192, ffn 28672 (SwiGLU), bf16, its
Linears split over the tensor-parallel group with sequence parallelism, as TE writes it. It is built
for 1, 2 and 4 ranks (bench/tp/pyproject.toml's tensor_parallel_size = [1, 2, 4]): MlpTp1 (the
single-GPU baseline: at size 1 the same spec is the unsharded block), MlpTp2 and MlpTp4.
"""

import transformer_engine.pytorch as te

HIDDEN = 8192
FFN = 28672
tp_group = None  # the generated module takes the group at construction

mlp = te.ops.Sequential(
    te.ops.Residual(
        te.ops.RMSNorm(HIDDEN),
        te.ops.Linear(HIDDEN, 2 * FFN, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
        te.ops.SwiGLU(),
        te.ops.Linear(FFN, HIDDEN, bias=False, tensor_parallel_mode="row", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
    ),
)

