"""Issue 41's benchmark layer: a Llama-3-70B decoder layer (hidden 8192, 64 query heads and 8
key/value heads of 128, rotary base 500000, SwiGLU ffn 28672, pre-norm RMSNorm, no biases) over
packed sequences, bf16, its Linears split over the tensor-parallel group with sequence parallelism:
the fused q, k, v projection column-parallel (each rank its share of the heads), the output
projection row-parallel, the MLP as bench/specs/tp_mlp.py's. Built for 1, 2 and 4 ranks, as the
block: LayerTp1 (the single-GPU baseline), LayerTp2, LayerTp4.
"""

import transformer_engine.pytorch as te

HIDDEN = 8192
HEADS = 64
KV_HEADS = 8
HEAD_DIM = HIDDEN // HEADS
FFN = 28672
tp_group = None  # the generated module takes the group at construction

layer = te.ops.Sequential(
    te.ops.Residual(
        te.ops.RMSNorm(HIDDEN),
        te.ops.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False, tensor_parallel_mode="column",
                      tensor_parallel_group=tp_group, sequence_parallel=True),
        te.ops.GroupedQueryAttention(HIDDEN, HEADS, KV_HEADS, te.DotProductAttention, rotary_base=500000.0),
        te.ops.Linear(HIDDEN, HIDDEN, bias=False, tensor_parallel_mode="row", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
    ),
    te.ops.Residual(
        te.ops.RMSNorm(HIDDEN),
        te.ops.Linear(HIDDEN, 2 * FFN, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
        te.ops.SwiGLU(),
        te.ops.Linear(FFN, HIDDEN, bias=False, tensor_parallel_mode="row", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
    ),
)
