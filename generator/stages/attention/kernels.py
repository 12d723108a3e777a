"""The attention prep kernels' specs (templates/attention_prep/, math in
templates/cuda/attention_prep.cuh): the forward's, from the fused QKV projection to one buffer
holding rotary(q), rotary(k) and v (none without rotary: q, k, v are views of the projection), and
the backward's, from FlashAttention-2's dq, dk, dv to the projection's grad (the rotary's
transpose, or a copy without rotary).

The rotary frequencies are the kernel's constants: inv_freq_i = base^(-2i / head_dim), computed
here in float64 and rounded once to fp32 (``rotary_inv_freq``), so every build and every test that
computes them the same way gets the same bits; the angle is fp32(position * inv_freq_i).

The table variant (``table=True``, templates/cuda/attention_prep_table.cuh) reads the angles from TE's
per-call table instead (forward(rotary_pos_emb=...): an op that ``reads_rotary_table``), at each
row's position clamped below ``table_rows``; its CPU launchers run ops/attention_rotary_table.py's
``attention_inputs_table`` / ``attention_inputs_table_bwd``."""

from __future__ import annotations

import struct

from ... import kernels as kn
from ...kernels import KernelParam as P
from ...ops.attention import attention_inputs, attention_inputs_bwd
from ...ops.attention_rotary_table import attention_inputs_table, attention_inputs_table_bwd


def attention_shape(op) -> tuple[int, int, int, float | None]:
    """(heads, kv_heads, head_dim, rotary_base) of a self-attention op."""
    heads, kv_heads, _, rotary_base, _ = op.opdef.reference_arguments(op.args)
    return heads, kv_heads, op.args["hidden"] // heads, rotary_base


def to_fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (as a Python float)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def rotary_inv_freq(base: float, head_dim: int) -> list[float]:
    """fp32(base^(-2i / head_dim)) for i < head_dim / 2: the rotary frequencies, each rounded once."""
    return [to_fp32(base ** (-(2 * i) / head_dim)) for i in range(head_dim // 2)]


def _hex_float(value: float) -> str:
    """An fp32 value as an exact C float literal: ``0x1.a11582p-1f``."""
    mantissa, _, exponent = float.hex(value).partition("p")
    return f"{mantissa.rstrip('0').rstrip('.')}p{exponent}f"


def _rope_tag(base: float) -> str:
    return f"rope{base:g}".replace(".", "p").replace("+", "")


def _spec(op, inverse: bool, table: bool = False) -> kn.KernelSpec:
    heads, kv_heads, head_dim, base = attention_shape(op)
    rotary = base is not None or table
    chain = "qkv_prep" + ("_table" if table else f"_{_rope_tag(base)}" if rotary else "")
    name = kn.kernel_name(chain, f"{'bwd' if inverse else 'fwd'}_h{heads}_kv{kv_heads}_d{head_dim}")
    what = (("the rotary's transpose of dq and dk, dv copied" if rotary else "dq, dk, dv copied") if inverse
            else "rotary of q and k, v copied") + (" (rotary by TE's per-call table)" if table else "")
    summary = f"attention prep {'backward' if inverse else 'forward'}: {what} ({heads} + 2 x {kv_heads} heads of {head_dim})"
    # the table variant also takes TE's table: float32 [table_rows, head_dim] angles
    by_table = (P("table", "const float*"), P("table_rows", "int")) if table else ()
    references = ((attention_inputs_table_bwd if inverse else attention_inputs_table) if table
                  else attention_inputs_bwd if inverse else attention_inputs)
    return kn.make_spec(
        name, "attention_prep", summary, headers=("attention_prep_table.cuh" if table else "attention_prep.cuh",),
        abi=(P("q", "const T*"), P("k", "const T*"), P("v", "const T*"), P("out", "T*"), P("cu_seqlens", "const int*"),
             *by_table, P("q_stride", "int"), P("kv_stride", "int"), P("batch", "int"), P("rows", "int")),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, rotary=rotary, inverse=inverse, rotary_base=base,
        table=table, inv_freq=tuple(_hex_float(f) for f in rotary_inv_freq(base, head_dim)) if base is not None else (),
        # what its CPU launcher runs: the op's reference helper (ops/attention*.py), shipped by name
        reference=references.__name__,
        align=head_dim // 2,  # a vector stays inside one half of a head (KernelSpec.vec)
        geometry="row_threads",
    )


def prep_forward(op) -> kn.KernelSpec | None:
    """The forward prep kernel of a self-attention op; None without rotary (q, k, v are views)."""
    return _spec(op, inverse=False) if attention_shape(op)[3] is not None else None


def prep_backward(op) -> kn.KernelSpec:
    """The backward prep kernel of a self-attention op (with or without rotary)."""
    return _spec(op, inverse=True)


def prep_table(op, inverse: bool) -> kn.KernelSpec | None:
    """The table variant of an op's forward or backward prep kernel, where it reads TE's per-call
    table (Op.rotary_table); None elsewhere."""
    return _spec(op, inverse, table=True) if op.rotary_table is not None else None
