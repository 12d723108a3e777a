"""Tensor and sequence parallelism (issue 41): TE's tensor-parallel Linears and communication ops,
each pipeline built for the tensor-parallel size pyproject.toml gives it
([tool.fusegen.pipelines.<name>] tensor_parallel_size). The group is the generated module's,
given at construction (``tensor_parallel_group=``): the spec's expression is only shown.
"""

import transformer_engine.pytorch as te

tp_group = None  # the process group: the generated module takes it at construction

# an MLP block split over 2 ranks, with sequence parallelism: each rank holds a share of the
# tokens for the norm, all-gathers them for the column-parallel Linear (its share of the SwiGLU's
# features), and reduce-scatters the row-parallel Linear's partial sums back to its tokens
tp_mlp = te.ops.Sequential(
    te.ops.RMSNorm(256),
    te.ops.Linear(256, 2048, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                  sequence_parallel=True),
    te.ops.SwiGLU(),
    te.ops.Linear(1024, 256, tensor_parallel_mode="row", tensor_parallel_group=tp_group, sequence_parallel=True),
)

# the same block over 4 ranks
tp_mlp4 = te.ops.Sequential(
    te.ops.RMSNorm(256),
    te.ops.Linear(256, 4096, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                  sequence_parallel=True),
    te.ops.SwiGLU(),
    te.ops.Linear(2048, 256, tensor_parallel_mode="row", tensor_parallel_group=tp_group, sequence_parallel=True),
)

# without sequence parallelism: the column-parallel Linear's input grad all-reduced, the
# row-parallel Linear's output all-reduced (tp_row built for 1, 2 and 4 ranks: pyproject.toml's
# tensor_parallel_size = [1, 2, 4] makes TpRowTp1, TpRowTp2 and TpRowTp4, and TpRow chooses by the
# group's size)
tp_column = te.ops.Sequential(te.ops.Linear(256, 512, tensor_parallel_mode="column", tensor_parallel_group=tp_group))
tp_row = te.ops.Sequential(te.ops.Linear(512, 256, tensor_parallel_mode="row", tensor_parallel_group=tp_group))

# TE's communication ops on their own
tp_comm = te.ops.Sequential(
    te.ops.AllGather(tp_group),
    te.ops.Linear(256, 256),
    te.ops.ReduceScatter(tp_group),
    te.ops.AllReduce(tp_group),
)

# the block with its residual (a Llama MLP block, sequence parallel): the add reads the rank's own
# tokens, kept across the collectives
tp_residual_mlp = te.ops.Sequential(
    te.ops.Residual(
        te.ops.RMSNorm(256),
        te.ops.Linear(256, 2048, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
        te.ops.SwiGLU(),
        te.ops.Linear(1024, 256, tensor_parallel_mode="row", tensor_parallel_group=tp_group, sequence_parallel=True),
    ),
)

# a Llama decoder layer over packed sequences, sequence parallel: each rank all-gathers the tokens
# for its share of the attention heads (the fused q, k, v projection split column-wise: a share of
# each of q, k and v) and of the MLP's features; the output projection and the MLP's second Linear
# are row-parallel, reduce-scattered back to the rank's tokens for the residual adds
tp_layer = te.ops.Sequential(
    te.ops.Residual(
        te.ops.RMSNorm(512),
        te.ops.Linear(512, (8 + 2 * 4) * 64, bias=False, tensor_parallel_mode="column",
                      tensor_parallel_group=tp_group, sequence_parallel=True),
        te.ops.GroupedQueryAttention(512, 8, 4, te.DotProductAttention, rotary_base=10000.0),
        te.ops.Linear(512, 512, bias=False, tensor_parallel_mode="row", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
    ),
    te.ops.Residual(
        te.ops.RMSNorm(512),
        te.ops.Linear(512, 2048, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
        te.ops.SwiGLU(),
        te.ops.Linear(1024, 512, bias=False, tensor_parallel_mode="row", tensor_parallel_group=tp_group,
                      sequence_parallel=True),
    ),
)

# TE's modules' spelling of the same splits: te.LayerNormMLP with set_parallel_mode (fc1 column-, fc2
# row-parallel), te.Linear with parallel_mode; as TE's modules, a row-parallel Linear's bias is added
# once, after the reduce-scatter (te.ops.Linear adds each rank's before it); tp_size=2 builds it for
# 2 ranks (pyproject.toml needs no table for it)
tp_te_modules = te.Sequential(
    te.LayerNormMLP(256, 1024, activation="swiglu", normalization="RMSNorm", set_parallel_mode=True,
                    sequence_parallel=True, tp_group=tp_group),
    te.Linear(256, 512, parallel_mode="column", tp_group=tp_group, sequence_parallel=True),
    te.Linear(512, 256, parallel_mode="row", tp_group=tp_group, sequence_parallel=True, tp_size=2),
)

# TE's te.TransformerLayer split as TE splits it (set_parallel_mode: the QKV projection and fc1
# column-parallel, the output projection and fc2 row-parallel, their biases added once after the
# reduce-scatter), sequence parallel over packed tokens ("thd"): the first layer holds TE's query,
# key and value blocks (each rank its share of each), the second one fused weight with its rows
# grouped per GQA group (qkv_weight_interleaved, TE's default: each rank its whole groups)
tp_te_layer = te.Sequential(
    te.TransformerLayer(256, 512, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                        normalization="RMSNorm", activation="swiglu", attn_input_format="thd",
                        set_parallel_mode=True, sequence_parallel=True, tp_group=tp_group, tp_size=2),
    te.TransformerLayer(256, 512, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                        normalization="RMSNorm", activation="swiglu", attn_input_format="thd",
                        fuse_qkv_params=True, set_parallel_mode=True, sequence_parallel=True, tp_group=tp_group,
                        tp_size=2),
)

# the same layer as TE's default writes it, x [seq, batch, hidden] ("sbhd"), sequence parallel: each
# rank holds its share of every sequence (dim 0, as TE splits it); the rows run in x's order and the
# attention reads them batch-major
tp_te_layer_sbhd = te.Sequential(
    te.TransformerLayer(256, 512, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                        normalization="RMSNorm", activation="swiglu", set_parallel_mode=True, sequence_parallel=True,
                        tp_group=tp_group, tp_size=2),
)
