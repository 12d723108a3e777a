"""Issue 39's done-when: whole models built of te.TransformerLayer (specs/te_models.py: a GPT-style
stack of three layers with other settings each, a Llama-style stack of two) load a state_dict laid
out with TE's names, compute TE's semantics (a float64 reference written here from TE's
transformer.py and multi_head_attention.py) and train exactly as the hand-written Sequential of the
same layers (gpt_stack, llama_stack in the same spec) on the CPU and on CUDA."""

import math

import pytest
import torch

import generated
from tests.ops.test_te_attention import assert_close_fa2, grad_groups
from tests.references import assert_close_to_reference

HIDDEN = 256
LENGTHS = [5, 1, 17, 9]  # the Llama stack's packed sequences (TE's "thd")
SEQ, BATCH = 12, 3  # the GPT stack's x [seq, batch, hidden] (TE's default "sbhd")

# The layers of each stack as the spec builds them: heads, kv groups, normalization, activation,
# zero-centred gamma, eps, biases, residual after the norm (apply_residual_connection_post_layernorm),
# the QKV parameters (TE's default split query/key/value, or fused with rows per GQA group)
GPT = [dict(heads=4, groups=4, norm="LayerNorm", act="gelu", zcg=False, eps=1e-5, bias=True, post=False, ffn=1024,
            qkv="split"),
       dict(heads=4, groups=4, norm="LayerNorm", act="qgelu", zcg=True, eps=1e-6, bias=True, post=False, ffn=1024,
            qkv="split"),
       dict(heads=4, groups=4, norm="LayerNorm", act="gelu", zcg=False, eps=1e-5, bias=True, post=True, ffn=1024,
            qkv="split")]
LLAMA = [dict(heads=8, groups=2, norm="RMSNorm", act="swiglu", zcg=False, eps=1e-5, bias=False, post=False, ffn=512,
              qkv="split"),
         dict(heads=8, groups=1, norm="RMSNorm", act="swiglu", zcg=False, eps=1e-5, bias=False, post=False, ffn=512,
              qkv="interleaved")]
BLOCKS = ("query", "key", "value")
STACKS = {"gpt": ("TeGptStack", "GptStack", GPT), "llama": ("TeLlamaStack", "LlamaStack", LLAMA)}


def inputs(stack, gen, device="cpu", dtype=torch.float32):
    """x and dy of a stack's form: GPT's [seq, batch, hidden], Llama's packed rows; and the call's
    keywords (Llama's lengths)."""
    shape = (SEQ, BATCH, HIDDEN) if stack == "gpt" else (sum(LENGTHS), HIDDEN)
    x, dy = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    keywords = {} if stack == "gpt" else {"seq_lens": torch.tensor(LENGTHS, device=device)}
    return x, dy, keywords


# --- TE's state_dict layout (transformer.py, multi_head_attention.py, layernorm_mlp.py) -------------

def te_layer_layout(cfg) -> dict:
    """One TransformerLayer's parameters as TE registers them (no _extra_state): with split QKV
    parameters (parameters_split, layernorm_linear.py) the query, key and value weights, then their
    biases."""
    hn = HIDDEN // cfg["heads"]
    qkv = (cfg["heads"] + 2 * cfg["groups"]) * hn
    fc1 = 2 * cfg["ffn"] if cfg["act"] == "swiglu" else cfg["ffn"]
    norm = lambda stem: {f"{stem}weight": (HIDDEN,), **({f"{stem}bias": (HIDDEN,)} if cfg["norm"] == "LayerNorm" else {})}
    bias = lambda name, n: {name: (n,)} if cfg["bias"] else {}
    stem = "self_attention.layernorm_qkv."
    rows = {"query": cfg["heads"] * hn, "key": cfg["groups"] * hn, "value": cfg["groups"] * hn}
    projection = ({**{f"{stem}{b}_weight": (rows[b], HIDDEN) for b in BLOCKS},
                   **{k: v for b in BLOCKS for k, v in bias(f"{stem}{b}_bias", rows[b]).items()}}
                  if cfg["qkv"] == "split" else {f"{stem}weight": (qkv, HIDDEN), **bias(f"{stem}bias", qkv)})
    return {**norm("self_attention.layernorm_qkv.layer_norm_"), **projection,
            "self_attention.proj.weight": (HIDDEN, HIDDEN), **bias("self_attention.proj.bias", HIDDEN),
            **norm("layernorm_mlp.layer_norm_"),
            "layernorm_mlp.fc1_weight": (fc1, HIDDEN), **bias("layernorm_mlp.fc1_bias", fc1),
            "layernorm_mlp.fc2_weight": (HIDDEN, cfg["ffn"]), **bias("layernorm_mlp.fc2_bias", HIDDEN)}


def te_stack_layout(layers) -> dict:
    return {f"{i}.{k}": shape for i, cfg in enumerate(layers) for k, shape in te_layer_layout(cfg).items()}


def as_q_k_v(p, layers) -> dict:
    """TE's parameters with each layer's QKV projection as one weight (and bias) of rows [all q
    heads | all k heads | all v heads], in TE's order otherwise: TE's split blocks concatenated
    (noop_cat), TE's rows per GQA group read through TE's view [groups, heads / groups + 2, hn]
    (multi_head_attention.py); differentiable, so grads reach TE's own parameters."""
    fused = {}
    for key, value in p.items():
        layer, _, name = key.partition(".")
        cfg = layers[int(layer)]
        stem, _, attr = name.rpartition("layernorm_qkv.")
        if not stem or "layer_norm" in attr:
            fused[key] = value
        elif cfg["qkv"] == "split" and attr.startswith("query_"):  # the key and value blocks join it
            kind = attr.removeprefix("query_")
            fused[f"{layer}.{stem}layernorm_qkv.{kind}"] = torch.cat(
                [p[f"{layer}.{stem}layernorm_qkv.{b}_{kind}"] for b in BLOCKS])
        elif cfg["qkv"] == "interleaved":
            per_group, hn = cfg["heads"] // cfg["groups"], HIDDEN // cfg["heads"]
            by_group = value.reshape(cfg["groups"], per_group + 2, hn, -1)
            q, k, v = by_group.split((per_group, 1, 1), dim=1)
            fused[key] = torch.cat([t.reshape(-1, *value.shape[1:]) for t in (q, k, v)])
    return fused


# --- the float64 reference of TE's semantics --------------------------------------------------------

def _norm(x, p, stem, cfg):
    gamma = p[f"{stem}weight"] + (1 if cfg["zcg"] else 0)  # TE stores gamma - 1 with zero_centered_gamma
    if cfg["norm"] == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg["eps"]) * gamma
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + cfg["eps"]) * gamma + p[f"{stem}bias"]


def _act(name, t):
    if name == "swiglu":
        a, b = t.chunk(2, dim=-1)
        return a * torch.sigmoid(a) * b
    if name == "qgelu":
        return t * torch.sigmoid(1.702 * t)
    return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))  # TE's gelu: tanh


def _attention(p, x, cfg, lengths):
    """Self-attention, causal, per packed sequence: TE's QKV view [(np/ng + 2), ng, hn]."""
    total, heads, groups = x.shape[0], cfg["heads"], cfg["groups"]
    hn, per_group = HIDDEN // heads, heads // groups
    mixed = x @ p["layernorm_qkv.weight"].T + p.get("layernorm_qkv.bias", 0)
    mixed = mixed.view(total, per_group + 2, groups, hn)
    q, k, v = mixed[:, :per_group].reshape(total, heads, hn), mixed[:, per_group], mixed[:, per_group + 1]
    out, start = torch.zeros(total, heads, hn, dtype=x.dtype), 0
    for n in lengths:
        rows = slice(start, start + n)
        for head in range(heads):
            scores = q[rows, head] @ k[rows, head // per_group].T / math.sqrt(hn)
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out[rows, head] = torch.softmax(scores, dim=-1) @ v[rows, head // per_group]
        start += n
    return out.reshape(total, HIDDEN) @ p["proj.weight"].T + p.get("proj.bias", 0)


def te_layer_reference(p, x, cfg, lengths):
    """TransformerLayer.forward of an encoder (transformer.py): h = r1 + attention(n1), y = r2 +
    mlp(n2), each residual r the block's input or, post-layernorm, its norm's output."""
    attention = {k.removeprefix("self_attention."): v for k, v in p.items() if k.startswith("self_attention.")}
    mlp = {k.removeprefix("layernorm_mlp."): v for k, v in p.items() if k.startswith("layernorm_mlp.")}
    n1 = _norm(x, attention, "layernorm_qkv.layer_norm_", cfg)
    h = (n1 if cfg["post"] else x) + _attention(attention, n1, cfg, lengths)
    n2 = _norm(h, mlp, "layer_norm_", cfg)
    m = _act(cfg["act"], n2 @ mlp["fc1_weight"].T + mlp.get("fc1_bias", 0)) @ mlp["fc2_weight"].T
    return (n2 if cfg["post"] else h) + m + mlp.get("fc2_bias", 0)


def te_stack_reference(p, x, layers, lengths=None):
    """The stack on packed rows (``lengths``), or on x [seq, batch, hidden] one batch column a
    sequence (TE's "sbhd") where no lengths are given; no dropout (TE in eval)."""
    if lengths is None:
        seq, batch = x.shape[:2]
        rows = te_stack_reference(p, x.transpose(0, 1).reshape(batch * seq, -1), layers, [seq] * batch)
        return rows.reshape(batch, seq, -1).transpose(0, 1)
    p = as_q_k_v(p, layers)
    for i, cfg in enumerate(layers):
        x = te_layer_reference({k.removeprefix(f"{i}."): v for k, v in p.items() if k.startswith(f"{i}.")}, x, cfg,
                               lengths)
    return x


# --- the modules -------------------------------------------------------------------------------------

def te_checkpoint(layers, seed):
    """Signed random parameters in TE's layout (a TE checkpoint's state_dict, _extra_state aside)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen) / (shape[-1] ** 0.5 if len(shape) == 2 else 1)
            for k, shape in te_stack_layout(layers).items()}


def handwritten_state(module, checkpoint, layers):
    """The TE checkpoint as the hand-written Sequential's state_dict: the same parameters in the
    same order (TE's layer: norm, QKV, proj, norm, fc1, fc2; the Sequential's residuals hold them
    so), each QKV projection as the one [q | k | v] weight its Linear holds (as_q_k_v)."""
    keys = [k for k in module.state_dict() if not k.endswith("_extra_state")]
    fused = as_q_k_v(checkpoint, layers)
    assert len(keys) == len(fused)
    return dict(zip(keys, fused.values()))


def load(module, state):
    """Loads ``state`` (TE's keys or the Sequential's) strictly, _extra_state entries as they are."""
    extra = {k: v for k, v in module.state_dict().items() if k.endswith("_extra_state")}
    module.load_state_dict({**state, **extra})


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_te_stack_holds_te_s_names_and_computes_te_s_semantics(stack):
    """In eval (TE's dropout off) against the float64 reference: output, grads of x and of every
    parameter."""
    te_name, _, layers = STACKS[stack]
    module = getattr(generated, te_name)(dtype=torch.float32).eval()
    names = {k: tuple(v.shape) for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    assert names == te_stack_layout(layers)
    checkpoint = te_checkpoint(layers, seed=3)
    load(module, checkpoint)
    x, dy, keywords = inputs(stack, torch.Generator().manual_seed(4))
    x.requires_grad_()
    y = module(x, **keywords)
    assert y.shape == x.shape and y.is_contiguous()
    y.backward(dy)
    p64 = {k: v.double().requires_grad_() for k, v in checkpoint.items()}
    x64 = x.detach().double().requires_grad_()
    want = te_stack_reference(p64, x64, layers, None if stack == "gpt" else LENGTHS)
    want.backward(dy.double())
    assert_close_to_reference(f"{te_name} y", y, want, torch.float32)
    assert_close_to_reference(f"{te_name} dx", x.grad, x64.grad, torch.float32)
    grads = dict(module.named_parameters())
    for names in grad_groups(p64):  # TE's query, key, value blocks together (grad_groups says why)
        got = torch.cat([grads[name].grad for name in names])
        assert_close_to_reference(f"{te_name} d{'+'.join(names)}", got, torch.cat([p64[n].grad for n in names]),
                                  torch.float32)


def _train(module, x, target, steps, keywords):
    """SGD steps from one seed: the dropout masks (GPT's) drawn from it."""
    torch.manual_seed(9)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = (module(x, **keywords).float() - target).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train_both(stack, device, dtype, steps):
    te_name, hand_name, layers = STACKS[stack]
    te_module = getattr(generated, te_name)(device=device, dtype=dtype)
    hand = getattr(generated, hand_name)(device=device, dtype=dtype)
    checkpoint = {k: v.to(device=device, dtype=dtype) for k, v in te_checkpoint(layers, seed=7).items()}
    load(te_module, checkpoint)
    load(hand, handwritten_state(hand, checkpoint, layers))
    x, target, keywords = inputs(stack, torch.Generator().manual_seed(8), device, dtype)
    te_losses = _train(te_module, x, target.float(), steps, keywords)
    hand_losses = _train(hand, x, target.float(), steps, keywords)
    return te_module, hand, te_losses, hand_losses


def _assert_same_parameters(te_module, hand, layers):
    te_state = {k: v for k, v in te_module.state_dict().items() if not k.endswith("_extra_state")}
    te_params = list(as_q_k_v(te_state, layers).items())
    hand_params = [v for k, v in hand.state_dict().items() if not k.endswith("_extra_state")]
    assert len(te_params) == len(hand_params)
    for (name, p), q in zip(te_params, hand_params):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_te_stack_trains_as_the_handwritten_sequential_on_the_cpu(stack):
    """The same weights, the same seed, the same steps of SGD in training mode (GPT's hidden and
    attention dropout on): the same kernels in the same order (the plans agree) and the same masks,
    so the same losses and parameters bit for bit."""
    te_module, hand, te_losses, hand_losses = _train_both(stack, "cpu", torch.float32, steps=3)
    assert te_losses == hand_losses
    assert te_losses[0] > te_losses[1] > te_losses[2], te_losses
    _assert_same_parameters(te_module, hand, STACKS[stack][2])


@pytest.mark.cuda
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_te_stack_in_bf16_on_cuda(stack):
    """bf16 on CUDA (FlashAttention-2): in eval against the float64 reference at TE's FA2
    tolerance, and trained (dropout on) as the hand-written Sequential."""
    te_name, _, layers = STACKS[stack]
    module = getattr(generated, te_name)(device="cuda", dtype=torch.bfloat16).eval()
    checkpoint = te_checkpoint(layers, seed=5)
    load(module, {k: v.cuda().bfloat16() for k, v in checkpoint.items()})
    x, dy, keywords = inputs(stack, torch.Generator().manual_seed(6), "cuda", torch.bfloat16)
    xg = x.requires_grad_()
    y = module(xg, **keywords)
    y.backward(dy)
    p64 = {k: v.bfloat16().double().requires_grad_() for k, v in checkpoint.items()}
    x64 = x.detach().cpu().double().requires_grad_()
    want = te_stack_reference(p64, x64, layers, None if stack == "gpt" else LENGTHS)
    want.backward(dy.cpu().double())
    grouped = any(cfg["groups"] != cfg["heads"] for cfg in layers)
    assert_close_fa2(f"{te_name} y", y, want, grouped)
    assert_close_fa2(f"{te_name} dx", xg.grad, x64.grad, grouped)
    grads = dict(module.named_parameters())
    for names in grad_groups(p64):
        got = torch.cat([grads[name].grad for name in names])
        assert_close_fa2(f"{te_name} d{'+'.join(names)}", got, torch.cat([p64[n].grad for n in names]), grouped)
    te_module, hand, te_losses, hand_losses = _train_both(stack, "cuda", torch.bfloat16, steps=3)
    assert te_losses == hand_losses
    _assert_same_parameters(te_module, hand, STACKS[stack][2])
