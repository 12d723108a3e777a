"""The Llama-3-8B layer as a Transformer Engine user writes it (specs/llama_layer.py's
``llama_layer_te``: te.TransformerLayer at TE's defaults but Llama's settings, split q/k/v
parameters, packed sequences; ``llama_layer_te_fused``, the same with TE's one fused QKV
weight), which bench/bench_layer.py times beside the hand-written spelling: their names and
layout, and on CUDA in bf16 against float64 TE semantics (te.TransformerLayer's reference of
test_te_transformer_layer.py, at its real sizes: 4096 hidden, 32 heads sharing 8 kv heads of 128,
SwiGLU of 14336), the fused spelling against the split one bit for bit."""

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
    gen = _randomized(module, 3)
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


@pytest.mark.cuda
def test_llama_layer_te_with_te_s_rotary_table_computes_the_hand_written_layer():
    """With TE's RotaryPositionEmbedding(128, rotary_base=500000) table (_te_rotary_table, as
    bench/bench_layer.py passes it), the te.TransformerLayer spelling computes what specs/llama_layer.py's
    hand-written LlamaLayer (GroupedQueryAttention(rotary_base=500000)) computes on the same
    weights: output, x's grad and every weight's grad, in bf16 on CUDA, to within TE's bf16
    attention tolerance of the largest value (the angles come from TE's fp32 table there, from
    fusegen's fp32 frequencies here; the rest is the same kernels)."""
    from tests.ops.test_attention_ops import fa2_tolerance
    te_layer = generated.LlamaLayerTe(device="cuda", dtype=torch.bfloat16)
    hand = generated.LlamaLayer(device="cuda", dtype=torch.bfloat16)
    gen = _randomized(te_layer, 5)
    state = {k: v for k, v in te_layer.state_dict().items() if not k.endswith("_extra_state")}
    qkv = torch.cat([state[f"{QKV}{b}_weight"] for b in ("query", "key", "value")])
    hand.load_state_dict({"0.0.weight": state[f"{QKV}layer_norm_weight"], "0.1.weight": qkv,
                          "0.3.weight": state["0.self_attention.proj.weight"],
                          "1.0.weight": state["0.layernorm_mlp.layer_norm_weight"],
                          "1.1.weight": state["0.layernorm_mlp.fc1_weight"],
                          "1.3.weight": state["0.layernorm_mlp.fc2_weight"]})
    lengths = [9, 1, 300]
    cu = torch.tensor([0, 9, 10, 310], dtype=torch.int32, device="cuda")
    x = torch.randn(sum(lengths), HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(sum(lengths), HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    xt, xh = x.clone().requires_grad_(), x.clone().requires_grad_()
    yt = te_layer(xt, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=300, max_seqlen_kv=300,
                  rotary_pos_emb=_te_rotary_table(300))
    yh = hand(xh, seq_lens=torch.tensor(lengths, dtype=torch.int32, device="cuda"), max_seqlen=300)
    yt.backward(dy)
    yh.backward(dy)
    grads = dict(te_layer.named_parameters())
    te_qkv = torch.cat([grads[f"{QKV}{b}_weight"].grad for b in ("query", "key", "value")])
    pairs = [("y", yt, yh), ("dx", xt.grad, xh.grad), ("dqkv", te_qkv, hand.get_parameter("0.1.weight").grad),
             ("dproj", grads["0.self_attention.proj.weight"].grad, hand.get_parameter("0.3.weight").grad),
             ("dfc1", grads["0.layernorm_mlp.fc1_weight"].grad, hand.get_parameter("1.1.weight").grad),
             ("dfc2", grads["0.layernorm_mlp.fc2_weight"].grad, hand.get_parameter("1.3.weight").grad),
             ("dnorm1", grads[f"{QKV}layer_norm_weight"].grad, hand.get_parameter("0.0.weight").grad),
             ("dnorm2", grads["0.layernorm_mlp.layer_norm_weight"].grad, hand.get_parameter("1.0.weight").grad)]
    tol = fa2_tolerance(torch.bfloat16, True)
    for what, got, want in pairs:
        err = (got.double() - want.double()).abs().max().item()
        scale = want.double().abs().max().item()
        assert err <= tol * scale, f"{what}: max |err| {err:.3e} > {tol} x {scale:.3e}"


def test_llama_layer_te_fused_holds_one_qkv_weight_under_te_s_name():
    """``llama_layer_te_fused`` (fuse_qkv_params=True, qkv_weight_interleaved=False): TE's one
    ``layernorm_qkv.weight`` in [q | k | v] row order, the other parameters as llama_layer_te's."""
    shapes = {k: tuple(v.shape) for k, v in generated.LlamaLayerTeFused(device="meta").state_dict().items()
              if not k.endswith("_extra_state")}
    split = {k: tuple(v.shape) for k, v in generated.LlamaLayerTe(device="meta").state_dict().items()
             if not k.endswith("_extra_state") and not k.endswith(("query_weight", "key_weight", "value_weight"))}
    assert shapes == {**split, f"{QKV}weight": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)}


@pytest.mark.cuda
def test_llama_layer_te_fused_computes_the_split_spelling_bit_for_bit():
    """With its fused weight the concatenation of the split spelling's blocks, the fused spelling
    runs the same kernels on the same joined weight: output, x's grad and every grad (the fused
    weight's against the blocks' together) equal, bit for bit, with TE's rotary table, twice (the
    second call replays CUDA graphs and adds into the grads)."""
    split = generated.LlamaLayerTe(device="cuda", dtype=torch.bfloat16)
    fused = generated.LlamaLayerTeFused(device="cuda", dtype=torch.bfloat16)
    gen = _randomized(split, 7)
    state = {k: v for k, v in split.state_dict().items()}
    blocks = [state.pop(f"{QKV}{b}_weight") for b in ("query", "key", "value")]
    fused.load_state_dict({**state, f"{QKV}weight": torch.cat(blocks)})
    cu = torch.tensor([0, 1, 2, 5, 8], dtype=torch.int32, device="cuda")
    table = _te_rotary_table(3)
    for step in range(2):
        x = torch.randn(8, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
        dy = torch.randn(8, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
        xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        ys, yf = (m(xi, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=3, max_seqlen_kv=3, rotary_pos_emb=table)
                  for m, xi in ((split, xs), (fused, xf)))
        ys.backward(dy)
        yf.backward(dy)
        torch.testing.assert_close(ys, yf, rtol=0, atol=0, msg=f"y, call {step}")
        torch.testing.assert_close(xs.grad, xf.grad, rtol=0, atol=0, msg=f"dx, call {step}")
    grads = {k: p.grad for k, p in split.named_parameters()}
    qkv = torch.cat([grads.pop(f"{QKV}{b}_weight") for b in ("query", "key", "value")])
    torch.testing.assert_close(qkv, fused.get_parameter(f"{QKV}weight").grad, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, fused.get_parameter(name).grad, rtol=0, atol=0, msg=name)


def _randomized(module, seed):
    """Sets ``module``'s parameters to random signed values (a weight's scaled by 1 / sqrt(its
    inputs)) from a generator seeded ``seed``; returns the generator, for the inputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if p.dim() == 2 else 1))
    return gen


def _te_rotary_table(max_len):
    """TE's RotaryPositionEmbedding(128, rotary_base=500000)(max_len) (attention/rope.py): float32
    angles [max_len, 1, 1, 128], cat(freqs, freqs), freqs = outer(positions, 1 / base^(2i / d))."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device="cuda") / HEAD_DIM))
    freqs = torch.einsum("i , j -> i j", torch.arange(max_len, dtype=torch.float32, device="cuda"), inv_freq)
    return torch.cat((freqs, freqs), dim=-1).reshape(max_len, 1, 1, HEAD_DIM)
