"""TE's attention modules' call forms (part of a fusegen output's runtime: templates/runtime/,
copied verbatim; do not edit): the dims of x each qkv_format takes, and TE's forward keywords
(MultiheadAttention.forward, TransformerLayer.forward) as fusegen's seq_lens / max_seqlen."""

import torch


_WINDOWS = {"causal": (-1, 0), "no_mask": (-1, -1)}  # TE's window_size for each mask: none


def te_sequences(module, seq_lens, max_seqlen, masks, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                 max_seqlen_kv=None, attention_mask=None, self_attn_mask_type=None, attn_mask_type=None,
                 window_size=None, rotary_pos_emb=None):
    """TE's forward keywords (MultiheadAttention.forward, TransformerLayer.forward) as fusegen's call
    form (seq_lens, max_seqlen, offsets): the offsets cu_seqlens_q (int32 [batch + 1]; cu_seqlens_kv
    the same in self-attention) handed on as they are, for packed_sequences to check with the
    lengths, max_seqlen_q (= max_seqlen_kv) the bound. The masks are the
    module's (``masks``): TE's keywords may name them, not change them. ``rotary_pos_emb`` (TE's
    per-call rotary table) reaches this only where no attention op reads a table (the module reads
    it itself where one does): its attention ops rotate by a rotary_base of their own."""
    if rotary_pos_emb is not None:  # refused, never dropped: q and k would be rotated twice, or by the wrong one
        raise ValueError(f"{module}: rotary_pos_emb (TE's per-call rotary table) is not taken here: this module's "
                         "attention ops rotate q and k by their own rotary_base; leave it None, or drop rotary_base "
                         "from the spec's attention ops to rotate by the table")
    if attention_mask is not None:
        raise ValueError(f"{module}: attention_mask must be None: the module's masks are {list(masks)}, "
                         "built in (TE reads attention_mask only for padding and arbitrary masks, which "
                         "fusegen refuses); pass the lengths of padded sequences as cu_seqlens_q instead")
    for name, given in (("self_attn_mask_type", self_attn_mask_type), ("attn_mask_type", attn_mask_type)):
        if given is not None and (len(masks) != 1 or given != masks[0]):
            raise ValueError(f"{module}: {name}={given!r}, but the module was built with {list(masks)}; "
                             "leave it None (the mask is the module's attn_mask_type)")
    if window_size is not None and (len(masks) != 1 or tuple(window_size) != _WINDOWS[masks[0]]):
        raise ValueError(f"{module}: window_size={window_size!r}: fusegen's attention has no sliding window; "
                         f"leave it None or pass {[_WINDOWS[m] for m in masks]} (its mask's)")
    te_form = (cu_seqlens_q is not None or cu_seqlens_kv is not None or max_seqlen_q is not None
               or max_seqlen_kv is not None)
    if te_form and (seq_lens is not None or max_seqlen is not None):
        raise ValueError(f"{module}: pass either fusegen's seq_lens / max_seqlen or TE's cu_seqlens_q / "
                         "cu_seqlens_kv / max_seqlen_q / max_seqlen_kv, not both")
    if not te_form:
        return seq_lens, max_seqlen, None
    same = ("cu_seqlens_q and cu_seqlens_kv must be the same offsets in self-attention (pass both, or "
            "neither)")
    if (cu_seqlens_q is None) != (cu_seqlens_kv is None):
        raise ValueError(f"{module}: {same}")
    if max_seqlen_q != max_seqlen_kv:
        raise ValueError(f"{module}: max_seqlen_q ({max_seqlen_q}) and max_seqlen_kv ({max_seqlen_kv}) must be "
                         "equal in self-attention")
    if cu_seqlens_q is None:
        return None, max_seqlen_q, None
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2 \
            or cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{module}: cu_seqlens_q must be int32 (or int64) offsets [batch + 1] starting at 0, "
                         f"got {cu_seqlens_q!r}")
    if cu_seqlens_kv is not cu_seqlens_q:  # on the device, no sync (torch.compile: no graph break)
        if cu_seqlens_kv.shape != cu_seqlens_q.shape:
            raise ValueError(f"{module}: {same}, got {list(cu_seqlens_q.shape)} and {list(cu_seqlens_kv.shape)}")
        torch._assert_async((cu_seqlens_q == cu_seqlens_kv).all(), f"{module}: {same}")
    return None, max_seqlen_q, cu_seqlens_q  # the offsets, checked with the lengths (packed_sequences)


_FORMS = {"sbhd": "a 3-D x [seq, batch, hidden]", "bshd": "a 3-D x [batch, seq, hidden]",
          "thd": "a 2-D x [total_tokens, hidden] of packed sequences"}


def check_format(module, x, seq_lens, qkv_format):
    """x's dims against a TE module's qkv_format, as TE's attention takes them."""
    if x.dim() != (2 if qkv_format == "thd" else 3):
        raise ValueError(f"{module}: qkv_format={qkv_format!r} takes {_FORMS[qkv_format]}, as TE does, got "
                         f"{list(x.shape)}" + ("; pass the lengths as seq_lens= (or cu_seqlens_q=)"
                                               if qkv_format == "thd" else ""))
    if seq_lens is not None and qkv_format != "thd":
        raise ValueError(f"{module}: seq_lens (packed sequences) takes qkv_format='thd'; this module's is "
                         f"{qkv_format!r}: every batch column is a sequence of x's full length")
