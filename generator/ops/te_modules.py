"""Transformer Engine's monolithic modules as macros: ``te.LayerNormLinear`` and ``te.LayerNormMLP``
in a spec expand to the te.ops basic ops they compute (``OpDef.expand``), so they fuse exactly as
the hand-written chain does, while their parameters keep TE's names and shapes (each basic op's
part: ``fc1`` gives ``fc1_weight``, ``fc1_bias``; ops.part_attribute), so a TE checkpoint's
``state_dict`` loads into the generated module and into fusegen.eager's module of the same name.

Each module's arguments are TE's, in TE's order with TE's defaults (read from TE's
transformer_engine/pytorch/module/layernorm_linear.py and layernorm_mlp.py), each either honoured
or refused at its position in the spec with the reason:
- honoured: the sizes, eps, bias, normalization, activation, zero_centered_gamma, params_dtype (the
  parameters' dtype), device, fuse_wgrad_accumulation (the weight grads added into
  ``weight.main_grad``: te.ops' accumulate_into_main_grad), return_layernorm_output (the norm's
  output handed out as the pipeline's next extra output: a MakeExtraOutput after the norm);
- accepted as TE's own no-ops for the values (``_hint``): what TE ignores without tensor or
  sequence parallelism (the ub_* userbuffers overlaps, return_layernorm_output_gathered), the JIT
  warm-up sizes (seq_length, micro_batch_size), ``name`` (debugging), ``ub_name``, ``checkpoint``
  (TE's recompute of fc1 in the backward: the same values, fusegen saves what its plan saves);
- honoured for tensor and sequence parallelism (issue 41, generator/tensor_parallel.py): LayerNormLinear's
  parallel_mode="column", LayerNormMLP's set_parallel_mode (fc1 column-, fc2 row-parallel),
  MultiheadAttention's (the QKV projection column-parallel: each rank its share of the heads, of each
  of TE's query, key and value blocks, or whole GQA groups; the output projection row-parallel) and
  TransformerLayer's (both), a row-parallel bias added once after the reduction, as TE's modules;
  their tp_group (the generated module's, given at construction), tp_size (where not 1: the build's
  tensor_parallel_size) and sequence_parallel;
- refused where given another value than TE's default: initialisers and
  the RNG tracker (fusegen initialises as te.ops does; load a checkpoint instead), return_bias (another
  output), parameters_split's dict of sizes (its tuple of names is honoured: the weight and bias
  as equal row blocks, ops/held_rows.py), delay_wgrad_compute (no backward_dw),
  activation_params (a dict: write te.ops.ClampedSwiGLU(limit=...) in a Sequential instead).
TE's modules default ``device="cuda"``; here, as for every op, the generated module's ``device=``
places the parameters unless the spec gives one.
"""

from .held_rows import HeldRows
from .opdef import OPS, Arg, OpDef, check_eps, check_features, register
from .te_namespace import TE_NAMESPACE

TE_MODULES = (TE_NAMESPACE, "fusegen.eager")  # a te.ops spelling (transformer_engine.pytorch.ops) is no module
# The ops that are TE's modules: their holders keep TE's _extra_state entry (the runtime's TeModuleOp, eager's)
TE_MACROS = ("LayerNormLinear", "LayerNormMLP", "MultiheadAttention", "TransformerLayer")  # te_layer.py: the last
# TE's modules built of TE's modules (plain torch modules in TE): no _extra_state of their own,
# their submodules (the parts before a dot: ops.part_submodule) each hold one
TE_COMPOSITES = ("MultiheadAttention", "TransformerLayer")

# TE's activation names (layernorm_mlp.py: _get_act_func_supported_list) -> fusegen's op; a gated one
# (a GLU) halves its input, so fc1 makes twice ffn_hidden_size, as TE's fc1_weight is laid out.
ACTIVATIONS = {"gelu": "GELU", "geglu": "GEGLU", "glu": "GLU", "qgelu": "QGELU", "qgeglu": "QGEGLU", "relu": "ReLU",
               "reglu": "ReGLU", "srelu": "SReLU", "sreglu": "SReGLU", "silu": "SiLU", "swiglu": "SwiGLU",
               "clamped_swiglu": "ClampedSwiGLU"}
GATED = frozenset(("geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"))


def _refused(why: str, default: object = None):
    """A check refusing any value but TE's default, with why and what to do."""
    return lambda v: None if v == default else why


_INIT = ("is an initialiser, which a spec cannot carry (fusegen never runs it): fusegen initialises the parameters "
         "as te.ops does; load a checkpoint or initialise them after construction, and leave it out")


def _hint(name, kind, default):
    """One of TE's hints that change no value fusegen computes (module docstring): any value is accepted."""
    return Arg(name, kind, default, in_kernel=False)


def _refuse(name, kind, default, why):
    """An argument refused but at TE's default; shown in the signature, which is TE's in full (so a
    positional argument's place reads as in TE)."""
    return Arg(name, kind, default, in_kernel=False, check=_refused(why, default))


# TE's modules' tensor- and sequence-parallel arguments, honoured (generator/tensor_parallel.py): the group
# (any expression: the generated module takes it at construction), its size (the build's where not 1)
_SEQUENCE_PARALLEL = Arg("sequence_parallel", "bool", False, in_kernel=False)
_TP_GROUP = Arg("tp_group", "group", None, in_kernel=False)
_TP_SIZE = Arg("tp_size", "int", 1, in_kernel=False, check=lambda v: None if v > 0 else "must be positive")
_SET_PARALLEL_MODE = Arg("set_parallel_mode", "bool", False, in_kernel=False)


_EPS = Arg("eps", "float", 1e-5, check=check_eps)
_BIAS = Arg("bias", "bool", True)
_NORMALIZATION = Arg("normalization", "str", "LayerNorm", check=lambda v: None if v in ("LayerNorm", "RMSNorm") else (
    f"must be 'LayerNorm' or 'RMSNorm' (TE's two), got {v!r}"))
_ZCG = Arg("zero_centered_gamma", "bool", False)
_PARAMS_DTYPE = Arg("params_dtype", "dtype", None, in_kernel=False)
# TE's rotary from forward(rotary_pos_emb=...) is rotate-half only in fusegen (its default); the
# interleaved form (adjacent feature pairs) would rotate other features, so it is refused here,
# where it is written, not at the forward call
_ROTARY_INTERLEAVED = _refuse("rotary_pos_interleaved", "bool", False,
                              "rotates adjacent feature pairs (interleaved rotary), which fusegen does not: its "
                              "rotary is rotate-half (first half / second half of each head, TE's default); "
                              "leave it False")
_WGRAD = Arg("fuse_wgrad_accumulation", "bool", False, in_kernel=False)  # honoured: accumulate_into_main_grad
_RETURN_LN = Arg("return_layernorm_output", "bool", False)
_RETURN_BIAS = _refuse("return_bias", "bool", False,
                       "returns the bias unadded beside the output, which fusegen's module does not; give bias=False "
                       "and add a te.ops.Bias after the module in the Sequential instead")
_DELAY = _refuse("delay_wgrad_compute", "bool", False,
                 "defers the weight grads to a backward_dw() call, which fusegen's module does not have; leave it False")
_TRACKER = _refuse("get_rng_state_tracker", "object", None, _INIT)
_UB = tuple(_hint(name, "bool", False) for name in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad"))
_UB_BULK = (_hint("ub_bulk_dgrad", "bool", False), _hint("ub_bulk_wgrad", "bool", False))
_SYMMETRIC_AR = _hint("symmetric_ar_type", "object", None)  # how TE all-reduces: fusegen's runtime chooses
_NAME = _hint("name", "str", None)
# TE's device (default "cuda" there): positional as in TE; None here, the generated module's device=
_DEVICE = Arg("device", "device", None, in_kernel=False)


def _norm(a: dict, size: int) -> tuple:
    kind = "RMSNorm" if a["normalization"] == "RMSNorm" else "LayerNorm"
    return (kind, {"normalized_shape": size, "eps": a["eps"], "device": a["device"], "dtype": a["params_dtype"],
                   "zero_centered_gamma": a["zero_centered_gamma"]}, "layer_norm")


def _linear(a: dict, part: str, in_features: int, out_features: int, held: HeldRows | None = None,
            mode: str | None = None) -> list[tuple]:
    """TE's GEMM with its optional bias: BasicLinear, then Bias where ``bias``; ``held``: how the
    part holds both (TE's QKV layouts), else one weight and one bias; ``mode``: its
    tensor-parallel mode ("column", "row"), over the module's tp_group, sequence parallel or not."""
    placed = {"device": a["device"], "dtype": a["params_dtype"]}
    parallel = {"tensor_parallel_mode": mode, "tensor_parallel_group": a.get("tp_group"),
                "sequence_parallel": a.get("sequence_parallel", False)} if mode else {}
    ops = [("BasicLinear", {"in_features": in_features, "out_features": out_features, **placed, **parallel,
                            "accumulate_into_main_grad": a["fuse_wgrad_accumulation"]}, part, held)]
    return ops + ([("Bias", {"size": out_features, **placed}, part, held)] if a["bias"] else [])


def _layernorm_output(a: dict) -> list[tuple]:
    """return_layernorm_output: the norm's output handed out (TE returns (out, ln_out))."""
    return [("MakeExtraOutput", {"in_place": False}, "layer_norm_output")] if a["return_layernorm_output"] else []


def _layernorm_linear(a: dict) -> list[tuple]:
    held = _split_blocks(a["parameters_split"], a["out_features"])
    return [_norm(a, a["in_features"]), *_layernorm_output(a),
            *_linear(a, "", a["in_features"], a["out_features"], held, a["parallel_mode"])]


def _split_blocks(names, out_features: int) -> HeldRows | None:
    """TE's parameters_split as a tuple of names (module/layernorm_linear.py): the weight and bias
    held as equal row blocks of one buffer, ``<name>_weight`` and ``<name>_bias`` (trailing
    underscores stripped, as TE does)."""
    if names is None:
        return None
    return HeldRows(blocks=tuple((name.rstrip("_"), out_features // len(names)) for name in names))


def _check_split(names) -> str | None:
    """parameters_split's form: TE's tuple of names (its dict of sizes is not read)."""
    if names is None:
        return None
    if not isinstance(names, tuple) or not names or not all(isinstance(name, str) for name in names):
        return ("must be a tuple of names, e.g. ('query_', 'key_', 'value_') (TE's parameters_split: the weight "
                "and bias split along dim 0 into equal blocks <name>_weight, <name>_bias)")
    stripped = [name.rstrip("_") for name in names]
    if not all(name.isidentifier() for name in stripped) or len(set(stripped)) != len(stripped):
        return f"must name distinct parameters (identifiers once trailing underscores go), got {names!r}"
    if "layer_norm" in stripped:
        return "must not name 'layer_norm', the norm's own layer_norm_weight and layer_norm_bias; choose another name"
    return None


def _validate_layernorm_linear(a: dict) -> str | None:
    names = a["parameters_split"]
    if names is not None and a["out_features"] % len(names):
        return (f"parameters_split splits out_features={a['out_features']} into {len(names)} equal blocks, "
                f"which it is not a multiple of")
    if a["parallel_mode"] is not None and names is not None:
        return ("parallel_mode with parameters_split would split each named block over the ranks, which fusegen "
                "does not yet; leave one of them out")
    if names is not None and a["fuse_wgrad_accumulation"]:
        return ("fuse_wgrad_accumulation=True adds the weight's grad into the one weight's main_grad, which fusegen "
                "does for a weight held whole only (TE keeps one per parameters_split block); leave one of the two "
                "out")
    return None


register(OpDef(
    "LayerNormLinear", "container", modules=TE_MODULES,
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features), _EPS,
          _SEQUENCE_PARALLEL, _WGRAD, _TP_GROUP, _TP_SIZE, _TRACKER, _refuse("init_method", "object", None, _INIT),
          _BIAS, _NORMALIZATION, _RETURN_BIAS, _PARAMS_DTYPE,
          # a norm before a row-parallel GEMM would normalise a rank's share of the features: not TE's math
          Arg("parallel_mode", "str", None, in_kernel=False, check=lambda v: None if v in (None, "column") else (
              f"must be None or 'column' (its output features split over the group), got {v!r}: a norm before a "
              "row-parallel GEMM reads whole rows; write te.LayerNorm or te.RMSNorm, then te.Linear(..., "
              "parallel_mode='row')")), _RETURN_LN,
          _hint("return_layernorm_output_gathered", "bool", False),
          Arg("parameters_split", "object", None, check=_check_split),
          _ZCG, _DEVICE, *_UB, *reversed(_UB_BULK), _hint("ub_name", "str", None), _DELAY, _SYMMETRIC_AR,
          _NAME),
    validate=_validate_layernorm_linear, expand=_layernorm_linear,
    summary="TE's module: LayerNorm or RMSNorm (layer_norm_weight, layer_norm_bias), then Linear (weight, bias)",
))


def _layernorm_mlp(a: dict) -> list[tuple]:
    hidden, ffn, activation = a["hidden_size"], a["ffn_hidden_size"], a["activation"]
    fc1_out = 2 * ffn if activation in GATED else ffn
    split = a.get("set_parallel_mode")  # fc1 column-parallel, fc2 row-parallel (TE's; a TransformerLayer: none yet)
    return [_norm(a, hidden), *_layernorm_output(a),
            *_linear(a, "fc1", hidden, fc1_out, mode="column" if split else None),
            (ACTIVATIONS[activation], {}, "activation"), *_linear(a, "fc2", ffn, hidden, mode="row" if split else None)]


register(OpDef(
    "LayerNormMLP", "container", modules=TE_MODULES,
    args=(Arg("hidden_size", "int", check=check_features), Arg("ffn_hidden_size", "int", check=check_features), _EPS,
          _SEQUENCE_PARALLEL, _RETURN_BIAS, _TRACKER, _TP_GROUP, _TP_SIZE,
          _refuse("init_method", "object", None, _INIT), _BIAS, _NORMALIZATION,
          Arg("activation", "str", "gelu", check=lambda v: None if v in ACTIVATIONS else (
              f"must be one of TE's activations: {', '.join(ACTIVATIONS)}; got {v!r}")),
          _refuse("activation_params", "object", None,
                  "is a dict of clamped_swiglu's constants, which fusegen reads only at TE's defaults (limit=7.0, "
                  "alpha=1.702, glu_linear_offset=1.0); for others write te.ops.ClampedSwiGLU(limit=...) between "
                  "te.ops.Linear ops in the Sequential"),
          _refuse("output_layer_init_method", "object", None, _INIT), _WGRAD, _PARAMS_DTYPE, _RETURN_LN,
          _hint("return_layernorm_output_gathered", "bool", False), _hint("seq_length", "int", None),
          _hint("micro_batch_size", "int", None), _SET_PARALLEL_MODE, _ZCG, _DEVICE,
          _UB[0], _NAME, *_UB[1:], *_UB_BULK, _DELAY, _SYMMETRIC_AR, _hint("checkpoint", "bool", False)),
    expand=_layernorm_mlp,
    summary="TE's module: LayerNorm or RMSNorm (layer_norm_weight, layer_norm_bias), fc1 (fc1_weight, fc1_bias; "
            "twice ffn_hidden_size for a gated activation), the activation, fc2 (fc2_weight, fc2_bias)",
))


# --- te.MultiheadAttention (TE's transformer_engine/pytorch/attention/multi_head_attention.py) ------

def _qkv_held(a: dict, heads: int, groups: int, head_dim: int) -> HeldRows | None:
    """How te.MultiheadAttention holds its QKV projection (multi_head_attention.py): with
    fuse_qkv_params=False (TE's default) as query, key and value row blocks (TE's
    parameters_split; TE then reads them as [q | k | v], its qkv_weight_interleaved forced off);
    with fuse_qkv_params=True and qkv_weight_interleaved=True (TE's default) as one weight whose
    rows go per GQA group; with both True/False as one weight [q | k | v], fusegen's own order."""
    if not a["fuse_qkv_params"]:
        return HeldRows(blocks=(("query", heads * head_dim), ("key", groups * head_dim), ("value", groups * head_dim)))
    if a["qkv_weight_interleaved"]:
        return HeldRows(groups=(groups, heads // groups))
    return None


def _split_wgrad(a: dict) -> str | None:
    """fuse_wgrad_accumulation adds the weight grad into the one weight's ``main_grad``; TE's split
    QKV parameters each have their own."""
    if a["fuse_wgrad_accumulation"] and (not a["fuse_qkv_params"] or a["qkv_weight_interleaved"]):
        return ("fuse_wgrad_accumulation=True adds the QKV weight's grad into one weight's main_grad, which "
                "fusegen does for a QKV weight held as one tensor in [q | k | v] order only; with it pass "
                "fuse_qkv_params=True, qkv_weight_interleaved=False")
    return None


def _attention_dropout(v):
    """TE's attention_dropout: the probability of dropping each softmax probability in training."""
    return None if 0 <= v < 1 else f"must be a probability in [0, 1), got {v!r}"


def _qkv_format(v):
    return None if v in ("sbhd", "bshd", "thd") else (
        f"must be 'sbhd' (x [seq, batch, hidden], TE's default), 'bshd' (x [batch, seq, hidden]) or 'thd' "
        f"(packed tokens [total, hidden] with cu_seqlens), got {v!r}")


def _validate_mha(a: dict) -> str | None:
    hidden, heads = a["hidden_size"], a["num_attention_heads"]
    groups = heads if a["num_gqa_groups"] is None else a["num_gqa_groups"]
    if hidden % heads:
        return f"num_attention_heads={heads} must divide hidden_size={hidden} (each head takes hidden / heads features)"
    if a["kv_channels"] not in (None, hidden // heads):
        return (f"kv_channels={a['kv_channels']}: fusegen's attention takes head_dim = hidden_size / "
                f"num_attention_heads = {hidden // heads}; leave kv_channels out or give that")
    if groups <= 0 or heads % groups:
        return f"num_gqa_groups={groups} must divide num_attention_heads={heads} (TE's rule)"
    return _split_wgrad(a) or OPS["GroupedQueryAttention"].validate(_attention_args(a))  # the head sizes it takes


def _attention_args(a: dict) -> dict:
    """The attention op's arguments: num_gqa_groups kv heads (TE: as many as the heads if None);
    attention_dropout in training (TE's DotProductAttention: ``attention_dropout if self.training
    else 0.0``)."""
    heads = a["num_attention_heads"]
    return {"hidden": a["hidden_size"], "heads": heads,
            "kv_heads": heads if a["num_gqa_groups"] is None else a["num_gqa_groups"],
            "attn_mask_type": a["attn_mask_type"], "rotary_base": None, "dropout": a["attention_dropout"],
            "qkv_format": a["qkv_format"]}


def _multihead_attention(a: dict) -> list[tuple]:
    hidden, heads = a["hidden_size"], a["num_attention_heads"]
    groups = _attention_args(a)["kv_heads"]
    qkv = (heads + 2 * groups) * (hidden // heads)
    held = _qkv_held(a, heads, groups, hidden // heads)
    split = a["set_parallel_mode"]  # the QKV projection column-, the output projection row-parallel (TE's)
    if a["input_layernorm"]:  # TE's layernorm_qkv: a LayerNormLinear
        norm = {**a, "eps": a["layernorm_epsilon"]}
        kind, norm_args, _ = _norm(norm, hidden)
        front = [(kind, norm_args, "layernorm_qkv.layer_norm"), *_layernorm_output(a),
                 *_linear(a, "layernorm_qkv.", hidden, qkv, held, "column" if split else None)]
    else:  # TE's qkv: a Linear (TE ignores return_layernorm_output without the norm)
        front = _linear(a, "qkv.", hidden, qkv, held, "column" if split else None)
    attention = ("GroupedQueryAttention", _attention_args(a), "core_attention.")  # TE's DotProductAttention
    return [*front, attention, *_linear(a, "proj.", hidden, hidden, mode="row" if split else None)]


register(OpDef(
    "MultiheadAttention", "container", modules=TE_MODULES,
    args=(Arg("hidden_size", "int", check=check_features), Arg("num_attention_heads", "int", check=check_features),
          Arg("kv_channels", "int", None),  # checked against hidden_size / num_attention_heads: _validate_mha
          Arg("attention_dropout", "float", 0.1, check=_attention_dropout),
          Arg("layernorm_epsilon", "float", 1e-5, check=check_eps),
          _refuse("init_method", "object", None, _INIT), _refuse("output_layer_init_method", "object", None, _INIT),
          _hint("layer_number", "int", None),  # TE's scaling of the unfused backend: the same softmax
          Arg("attn_mask_type", "str", "causal", check=lambda v: None if v in ("causal", "no_mask") else (
              f"must be 'causal' or 'no_mask', got {v!r}; other masks (padding, arbitrary, sliding window) are "
              "not supported")),
          _refuse("window_size", "object", None, "is sliding-window attention, which fusegen does not support; "
                  "leave it out"),
          _hint("bottom_right_diagonal", "bool", None),  # self-attention: q and kv lengths agree, one diagonal
          _TP_GROUP, _TP_SIZE,
          Arg("num_gqa_groups", "int", None, check=lambda v: None if v is None or v > 0 else "must be positive"),
          _WGRAD, _TRACKER, _SEQUENCE_PARALLEL, _PARAMS_DTYPE, _RETURN_BIAS,
          _RETURN_LN, Arg("input_layernorm", "bool", False),
          _refuse("attention_type", "str", "self", "is cross-attention (a second input, the encoder's output), "
                  "which fusegen's pipelines do not take; only attention_type='self'"),
          _SET_PARALLEL_MODE,
          Arg("fuse_qkv_params", "bool", False, in_kernel=False), _ZCG,
          Arg("qkv_weight_interleaved", "bool", True, in_kernel=False),
          _ROTARY_INTERLEAVED,
          *_UB, *_UB_BULK, _BIAS, _NORMALIZATION, _DEVICE,
          Arg("qkv_format", "str", "sbhd", in_kernel=False, check=_qkv_format), _NAME,
          _refuse("qk_norm_type", "str", None, "normalises q and k, which fusegen's attention does not; leave it out"),
          _hint("qk_norm_eps", "float", 1e-6), _hint("qk_norm_before_rope", "bool", False),
          _hint("seq_length", "int", None), _hint("micro_batch_size", "int", None),
          _refuse("softmax_type", "str", "vanilla", "changes the softmax (a learnable or off-by-one sink), which "
                  "fusegen's attention does not; leave it 'vanilla'")),
    validate=_validate_mha, expand=_multihead_attention, hint_stem="mha",
    summary="TE's module (self-attention): with input_layernorm LayerNorm or RMSNorm (layernorm_qkv.layer_norm_weight, "
            "layernorm_qkv.layer_norm_bias) and the QKV Linear (layernorm_qkv.query_weight, key_weight, "
            "value_weight and their biases; with fuse_qkv_params=True one weight and bias, rows grouped per GQA "
            "group unless qkv_weight_interleaved=False), else the Linear (qkv.*, the same); attention over packed "
            "sequences (num_gqa_groups kv heads); the output projection (proj.weight, proj.bias)",
))
