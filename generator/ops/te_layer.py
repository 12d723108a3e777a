"""Transformer Engine's ``te.TransformerLayer`` as a macro (issue 39): an encoder layer expands to
its self-attention (te.MultiheadAttention's parts under ``self_attention.``), its MLP
(te.LayerNormMLP's under ``layernorm_mlp.``) and, with ``output_layernorm``, the output norm
(``layernorm.``), each block's output through a Dropout(hidden_dropout) and added to its residual
(``OpDef.residuals``: a tee and an add around the block, as a te.Residual's), so the layer fuses
as the hand-written chain does and a TE checkpoint's ``state_dict`` loads under TE's names
(``0.self_attention.layernorm_qkv.weight``, ``0.layernorm_mlp.fc1_weight``).

TE's semantics (transformer_engine/pytorch/transformer.py, TransformerLayer.forward, an encoder):
pre-norm by default, h = x + dropout(attention(norm1(x))), y = h + dropout(mlp(norm2(h))); with
``apply_residual_connection_post_layernorm`` the residual is the norm's output, h = n1 + dropout(
attention(n1)) with n1 = norm1(x); with ``output_layernorm`` the attention has no input norm and
the layer's output goes through a last norm. The arguments are TE's, in TE's order with TE's
defaults, each honoured or refused as te.MultiheadAttention's and te.LayerNormMLP's are
(ops/te_modules.py); the layer's own: ``layer_type`` "encoder" only (a decoder's cross-attention
takes a second input), ``parallel_attention_mlp`` and ``drop_path_rate`` refused,
``ub_tp_comm_overlap`` a no-op without tensor parallelism.
"""

from .opdef import Arg, OpDef, check_eps, check_features, register
from .te_modules import (_BIAS, _DEVICE, _INIT, _NAME, _NORMALIZATION, _PARAMS_DTYPE, _ROTARY_INTERLEAVED,
                         _SEQUENCE_PARALLEL, _SET_PARALLEL_MODE, _TP_GROUP, _TP_SIZE, _TRACKER, _WGRAD, _ZCG,
                         ACTIVATIONS, TE_MODULES, _attention_dropout, _hint, _layernorm_mlp, _multihead_attention,
                         _qkv_format, _refuse, _validate_mha)

_MHA_ARGS = ("hidden_size", "num_attention_heads", "kv_channels", "attention_dropout", "layernorm_epsilon",
             "num_gqa_groups", "fuse_wgrad_accumulation", "params_dtype", "fuse_qkv_params", "zero_centered_gamma",
             "qkv_weight_interleaved", "bias", "normalization", "device",
             "tp_group", "sequence_parallel", "set_parallel_mode")  # (TE's layer splits both blocks alike)


def _attention_args(a: dict, input_layernorm: bool) -> dict:
    """te.MultiheadAttention's arguments as TransformerLayer.__init__ passes them (its norm's output
    is the residual with apply_residual_connection_post_layernorm: the tee after it, not an output)."""
    return {**{name: a[name] for name in _MHA_ARGS}, "attn_mask_type": a["self_attn_mask_type"],
            "qkv_format": a["attn_input_format"], "input_layernorm": input_layernorm,
            "return_layernorm_output": False}


def _mlp_args(a: dict) -> dict:
    return {"hidden_size": a["hidden_size"], "ffn_hidden_size": a["ffn_hidden_size"], "eps": a["layernorm_epsilon"],
            "fuse_wgrad_accumulation": a["fuse_wgrad_accumulation"], "bias": a["bias"],
            "normalization": a["normalization"], "activation": a["activation"], "params_dtype": a["params_dtype"],
            "return_layernorm_output": False, "zero_centered_gamma": a["zero_centered_gamma"], "device": a["device"],
            **{name: a[name] for name in ("tp_group", "sequence_parallel", "set_parallel_mode")}}


def _in(submodule: str, parts: list[tuple]) -> list[tuple]:
    """Parts of one of TE's modules as a submodule of the layer holds them ("layernorm_mlp.fc1")."""
    return [(op, args, f"{submodule}.{part}" if part else f"{submodule}.", *held) for op, args, part, *held in parts]


def _dropout(a: dict, block: str) -> list[tuple]:
    """TE's bias-dropout-add: dropout on the block's output before the residual add (none at p=0)."""
    return [("Dropout", {"p": a["hidden_dropout"]}, f"{block}_hidden_dropout")] if a["hidden_dropout"] else []


def _blocks(a: dict) -> tuple[list[tuple], list[tuple]]:
    """The attention and the MLP blocks, each its parts and dropout; the norm that opens each comes
    first (the residual starts after it with apply_residual_connection_post_layernorm)."""
    attention = _in("self_attention", _multihead_attention(_attention_args(a, not a["output_layernorm"])))
    mlp = _in("layernorm_mlp", _layernorm_mlp(_mlp_args(a)))
    return attention + _dropout(a, "attention"), mlp + _dropout(a, "mlp")


def _opens_with_norm(a: dict, block: str) -> bool:
    """Whether the residual of ``block`` starts after its first part, the norm: post-layernorm
    residuals (the attention's only where it has an input norm)."""
    post = a["apply_residual_connection_post_layernorm"]
    return post and (block == "mlp" or not a["output_layernorm"])


def _transformer_layer(a: dict) -> list[tuple]:
    attention, mlp = _blocks(a)
    out = []
    if a["output_layernorm"]:
        norm_kind = "RMSNorm" if a["normalization"] == "RMSNorm" else "LayerNorm"
        out = [(norm_kind, {"normalized_shape": a["hidden_size"], "eps": a["layernorm_epsilon"], "device": a["device"],
                            "dtype": a["params_dtype"], "zero_centered_gamma": a["zero_centered_gamma"]}, "layernorm.")]
    return attention + mlp + out


def _residuals(a: dict) -> tuple[tuple[int, int, str], ...]:
    attention, mlp = _blocks(a)
    first_attention = 1 if _opens_with_norm(a, "attention") else 0
    first_mlp = len(attention) + (1 if _opens_with_norm(a, "mlp") else 0)
    return ((first_attention, len(attention), "attention"), (first_mlp, len(attention) + len(mlp), "mlp"))


def _validate(a: dict) -> str | None:
    return _validate_mha(_attention_args(a, True))


register(OpDef(
    "TransformerLayer", "container", modules=TE_MODULES,
    args=(Arg("hidden_size", "int", check=check_features), Arg("ffn_hidden_size", "int", check=check_features),
          Arg("num_attention_heads", "int", check=check_features),
          Arg("num_gqa_groups", "int", None, check=lambda v: None if v is None or v > 0 else "must be positive"),
          Arg("layernorm_epsilon", "float", 1e-5, check=check_eps),
          Arg("hidden_dropout", "float", 0.1, check=lambda v: None if 0 <= v < 1 else f"must be in [0, 1), got {v!r}"),
          Arg("attention_dropout", "float", 0.1, check=_attention_dropout),
          _refuse("init_method", "object", None, _INIT), _refuse("output_layer_init_method", "object", None, _INIT),
          _hint("layer_number", "int", None), Arg("kv_channels", "int", None),
          Arg("self_attn_mask_type", "str", "causal", check=lambda v: None if v in ("causal", "no_mask") else (
              f"must be 'causal' or 'no_mask', got {v!r}; other masks (padding, arbitrary, sliding window) are "
              "not supported")),
          _refuse("window_size", "object", None, "is sliding-window attention, which fusegen does not support; "
                  "leave it out"),
          _hint("bottom_right_diagonal", "bool", None),
          _hint("enc_dec_attn_mask_type", "str", "no_mask"),  # the decoder's (refused) cross-attention only
          _hint("enc_dec_bottom_right_diagonal", "bool", None), _hint("enc_dec_window_size", "object", None),
          _TP_GROUP, _TP_SIZE, _PARAMS_DTYPE, _TRACKER, _WGRAD,
          _hint("seq_length", "int", None), _hint("micro_batch_size", "int", None),
          _SEQUENCE_PARALLEL,
          Arg("apply_residual_connection_post_layernorm", "bool", False), Arg("output_layernorm", "bool", False),
          _refuse("parallel_attention_mlp", "bool", False, "computes attention and MLP from the same input (Falcon), "
                  "which fusegen's layer does not; leave it False"),
          _refuse("layer_type", "str", "encoder", "is a decoder layer, whose cross-attention reads a second input "
                  "(the encoder's output), which fusegen's pipelines do not take; only layer_type='encoder'"),
          _refuse("drop_path_rate", "float", 0.0, "drops whole samples' paths (stochastic depth), which fusegen "
                  "does not; leave it 0.0"),
          _SET_PARALLEL_MODE,
          Arg("fuse_qkv_params", "bool", False, in_kernel=False),
          _ROTARY_INTERLEAVED, _ZCG,
          Arg("qkv_weight_interleaved", "bool", True, in_kernel=False),
          _hint("ub_tp_comm_overlap", "bool", False),
          *(_hint(name, "bool", default) for name, default in (
              ("ub_overlap_ag", True), ("ub_overlap_rs", True), ("ub_overlap_rs_dgrad", False),
              ("ub_bulk_dgrad", True), ("ub_bulk_wgrad", True))),  # TE: off unless ub_tp_comm_overlap
          _BIAS, Arg("activation", "str", "gelu", check=lambda v: None if v in ACTIVATIONS else (
              f"must be one of TE's activations: {', '.join(ACTIVATIONS)}; got {v!r}")),
          _refuse("activation_params", "object", None, "is a dict of clamped_swiglu's constants, which fusegen "
                  "reads only at TE's defaults; leave it out"),
          _NORMALIZATION, _DEVICE, Arg("attn_input_format", "str", "sbhd", in_kernel=False, check=_qkv_format), _NAME,
          _refuse("qk_norm_type", "str", None, "normalises q and k, which fusegen's attention does not; leave it out"),
          _hint("qk_norm_eps", "float", 1e-6), _hint("qk_norm_before_rope", "bool", False),
          _refuse("softmax_type", "str", "vanilla", "changes the softmax (a learnable or off-by-one sink), which "
                  "fusegen's attention does not; leave it 'vanilla'")),
    validate=_validate, expand=_transformer_layer, residuals=_residuals, hint_stem="layer",
    summary="TE's encoder layer: Residual(self_attention: te.MultiheadAttention's parts, Dropout), "
            "Residual(layernorm_mlp: te.LayerNormMLP's parts, Dropout) [, the output norm]",
))
