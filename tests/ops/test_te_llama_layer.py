"""The Llama-3-8B layer as a Transformer Engine user writes it (specs/llama_layer.py's
``llama_layer_te``: te.TransformerLayer at TE's defaults but Llama's settings, split q/k/v
parameters, packed sequences), which bench/bench_layer.py times beside the hand-written spelling:
its names and layout, and on CUDA in bf16 against float64 TE semantics (te.TransformerLayer's
reference of test_te_transformer_layer.py, at its real sizes: 4096 hidden, 32 heads sharing 8 kv
heads of 128, SwiGLU of 14336)."""

import pytest
import torch

import generated
from tests.ops.test_te_attention import assert_close_fa2, grad_groups
from tests.ops.test_te_transformer_layer import te_layer_reference

HIDDEN, HEADS, KV_HEADS, FFN, HEAD_DIM = 4096, 32, 8, 14336, 128
LLAMA = (HEADS, KV_HEADS, "RMSNorm", "swiglu", False, False, False, False, True)  # te_layer_reference's case
QKV = "0.self_attention.layernorm_qkv."


def test_llama_layer_te_holds_te_s_names_and_shapes():
    module = generated.LlamaLayerTe(device="meta")
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    assert shapes == {f"{QKV}layer_norm_weight": (HIDDEN,), f"{QKV}query_weight": (HEADS * HEAD_DIM, HIDDEN),
                      f"{QKV}key_weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                      f"{QKV}value_weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                      "0.self_attention.proj.weight": (HIDDEN, HIDDEN),
                      "0.layernorm_mlp.layer_norm_weight": (HIDDEN,),
                      "0.layernorm_mlp.fc1_weight": (2 * FFN, HIDDEN), "0.layernorm_mlp.fc2_weight": (HIDDEN, FFN)}


@pytest.mark.cuda
def test_llama_layer_te_in_bf16_against_float64():
    """bf16 on CUDA (FlashAttention-2, no rotary table: TE's rotary_pos_emb=None) against the float64
    reference: output, grads of x and of every parameter, at TE's FA2 tolerance."""
    module = generated.LlamaLayerTe(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if p.dim() == 2 else 1))
    lengths = [9, 1, 30]
    x = torch.randn(sum(lengths), HIDDEN, generator=gen)
    dy = torch.randn(sum(lengths), HIDDEN, generator=gen)
    xc = x.to("cuda", torch.bfloat16).requires_grad_()
    cu = torch.tensor([0, 9, 10, 40], dtype=torch.int32, device="cuda")
    y = module(xc, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=30, max_seqlen_kv=30)
    y.backward(dy.to("cuda", torch.bfloat16))
    p64 = {k.removeprefix("0."): v.detach().double().cpu().requires_grad_()
           for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    x64 = x.to(torch.bfloat16).double().requires_grad_()
    want = te_layer_reference(p64, x64, LLAMA, lengths)
    want.backward(dy.to(torch.bfloat16).double())
    assert_close_fa2("y", y, want, True)
    assert_close_fa2("dx", xc.grad, x64.grad, True)
    grads = dict(module.named_parameters())
    for names in grad_groups(p64):  # TE's query, key, value blocks together (grad_groups says why)
        got = torch.cat([grads[f"0.{name}"].grad for name in names])
        assert_close_fa2(f"d{'+'.join(names)}", got, torch.cat([p64[n].grad for n in names]), True)
