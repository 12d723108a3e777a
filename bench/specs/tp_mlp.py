"""Issue 41's benchmark block: the Llama MLP block at hidden 8192, ffn 28672 (SwiGLU), bf16, its
Linears split over the tensor-parallel group with sequence parallelism, as TE writes it. A pipeline
is built for one group size (bench/tp/pyproject.toml), so the block is written once a size: mlp_tp1
(the single-GPU baseline: at size 1 the same spec is the unsharded block), mlp_tp2, mlp_tp4.
"""

import transformer_engine.pytorch as te

HIDDEN = 8192
FFN = 28672
tp_group = None  # the generated module takes the group at construction

mlp_tp1 = te.ops.Sequential(
    te.ops.Residual(
        te.ops.RMSNorm(HIDDEN),
        te.ops.Linear(HIDDEN, 2 * FFN, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
        te.ops.SwiGLU(),
        te.ops.Linear(FFN, HIDDEN, bias=False, tensor_parallel_mode="row", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
    ),
)

mlp_tp2 = te.ops.Sequential(
    te.ops.Residual(
        te.ops.RMSNorm(HIDDEN),
        te.ops.Linear(HIDDEN, 2 * FFN, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
        te.ops.SwiGLU(),
        te.ops.Linear(FFN, HIDDEN, bias=False, tensor_parallel_mode="row", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
    ),
)

mlp_tp4 = te.ops.Sequential(
    te.ops.Residual(
        te.ops.RMSNorm(HIDDEN),
        te.ops.Linear(HIDDEN, 2 * FFN, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
        te.ops.SwiGLU(),
        te.ops.Linear(FFN, HIDDEN, bias=False, tensor_parallel_mode="row", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
    ),
)
