"""Independent float64 references for the shipped pipelines, written from the TE op catalog with
torch.nn.functional and autograd (the large pipelines' GEMMs with a Linear of this file's own that
streams the module's weights: StreamedWeight). They share no code with the generator or the
generated package."""

import math

import torch
import torch.nn.functional as F

EPS = 1e-5


def module_names(package):
    """The generated modules a package exports (its ``__all__`` holds its FP8 recipes and autocast
    too, where a pipeline is built for FP8) that one process runs: those built for a tensor-parallel
    group of several ranks (``tensor_parallel_shards``) need one process a rank, and
    tests/runtime/test_tensor_parallel.py runs them."""
    return sorted(name for name in package.__all__
                  if isinstance(getattr(package, name), type) and issubclass(getattr(package, name), torch.nn.Module)
                  and not hasattr(getattr(package, name), "tensor_parallel_shards"))


def linear(x, w, b=None):
    """F.linear, or for a weight given as a StreamedWeight (the large pipelines' GEMMs) the same
    product with the module's own weight read a block of rows at a time."""
    return _StreamedLinear.apply(x, w, b) if isinstance(w, StreamedWeight) else F.linear(x, w, b)


def swiglu(t):
    a, b = t.chunk(2, dim=-1)  # TE gates the FIRST half
    return F.silu(a) * b


def rms_norm(x, w, eps=EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layer_norm(x, w, b, eps=EPS):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def te_mlp(p, x):
    h = linear(layer_norm(x, p["0.weight"], p["0.bias"]), p["1.weight"], p["1.bias"])
    return (linear(swiglu(h), p["3.weight"], p["3.bias"]),)


def fc1(p, x):
    n = layer_norm(x, p["0.weight"], p["0.bias"])
    return swiglu(linear(n, p["2.weight"], p["2.bias"])), n


def fc2(p, x, residual):
    return (linear(x, p["0.weight"], p["0.bias"]) + residual,)


def prenorm_block(p, x, residual):
    return linear(rms_norm(x, p["1.weight"]), p["2.weight"], p["2.bias"]) + residual, x


def gpt2_mlp(p, x):
    h = F.gelu(linear(layer_norm(x, p["0.weight"], p["0.bias"]), p["1.weight"], p["1.bias"]), approximate="tanh")
    return (linear(h, p["3.weight"], p["3.bias"]),)


def elementwise_chain(p, x, r1, r8, r13):
    h = F.relu(x) + r1
    n = layer_norm(h, 1 + p["3.weight"], p["3.bias"], eps=1e-6)  # zero-centered gamma
    t = F.gelu((n + p["4.bias"]) * 0.5, approximate="tanh")
    e7 = t
    t = F.silu(t + r8) + p["11.bias"]
    a, b = t.chunk(2, dim=-1)
    t = F.silu(F.gelu(a, approximate="tanh") * b + r13)
    t = rms_norm(linear(t, p["15.weight"]), 1 + p["16.weight"])
    return swiglu(t), h, e7


def clamped_swiglu(t, limit=7.0, alpha=1.702, offset=1.0):
    """GPT-OSS (TE's ClampedSwiGLU): gate = first half, clamped above; linear half clamped both ways.
    Gradients come from autograd through clamp, which passes none where a clamp is active."""
    a, b = t.chunk(2, dim=-1)
    g = a.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (b.clamp(-limit, limit) + offset)


def srelu(t):
    return F.relu(t).square()


def gpt_oss_mlp(p, x):
    h = linear(rms_norm(x, p["0.weight"]), p["1.weight"], p["1.bias"])
    return (linear(clamped_swiglu(h, limit=6.0, alpha=1.5, offset=0.5), p["3.weight"], p["3.bias"]),)


def relu2_mlp(p, x):
    h = linear(layer_norm(x, p["0.weight"], p["0.bias"]), p["1.weight"], p["1.bias"])
    return (linear(srelu(h), p["3.weight"], p["3.bias"]),)


def qgelu(t):
    return t * torch.sigmoid(1.702 * t)


def gated(t, act, up=lambda b: b):
    """TE's GLU family: act(first half) * up(second half)."""
    a, b = t.chunk(2, dim=-1)
    return act(a) * up(b)


GLU_GATES = {  # TE's gates, float64
    "glu": torch.sigmoid,
    "qgeglu": qgelu,
    "reglu": F.relu,
    "sreglu": lambda a: F.relu(a).square(),
}


def situglu(t, beta1=4.0, beta2=25.0):
    return gated(t, lambda a: beta1 * torch.tanh(a / beta1) * torch.sigmoid(a), lambda b: beta2 * torch.tanh(b / beta2))


def mlp(act):
    """Linear, act, Linear: the te_activations spec's pipelines."""
    return lambda p, x: (linear(act(linear(x, p["0.weight"], p["0.bias"])), p["2.weight"], p["2.bias"]),)


def l2_normalization(t, eps):
    return t / (t.square().sum(-1, keepdim=True) + eps).sqrt()


# name -> (generated class name, reference, number of extra inputs)
def residual_blocks(p, x):
    """specs/residual_blocks.py: two pre-norm Residuals, y = x + ops(x) each."""
    mlp = linear(F.gelu(linear(rms_norm(x, p["0.0.weight"]), p["0.1.weight"], p["0.1.bias"]), approximate="tanh"),
                 p["0.3.weight"], p["0.3.bias"])
    h = x + mlp
    return (h + linear(layer_norm(h, p["1.0.weight"], p["1.0.bias"]), p["1.1.weight"]),)


def nested_residual(p, x):
    """specs/residual_blocks.py: a Residual inside a Residual, between a GEMM and a norm."""
    a = linear(x, p["0.weight"])
    n = layer_norm(a, p["1.0.weight"], p["1.0.bias"])
    inner = n + linear(rms_norm(n, p["1.1.0.weight"]), p["1.1.1.weight"], p["1.1.1.bias"])
    return (rms_norm(a + F.gelu(inner, approximate="tanh"), p["2.weight"]),)


PIPELINES = {
    "elementwise_chain": ("ElementwiseChain", elementwise_chain, 3),
    "te_mlp": ("TeMlp", te_mlp, 0),
    "fc1": ("Fc1", fc1, 0),
    "fc2": ("Fc2", fc2, 1),
    "prenorm_block": ("PrenormBlock", prenorm_block, 1),
    "gpt2_mlp": ("Gpt2Mlp", gpt2_mlp, 0),
    "gpt_oss_mlp": ("GptOssMlp", gpt_oss_mlp, 0),
    "relu2_mlp": ("Relu2Mlp", relu2_mlp, 0),
    "qgelu_mlp": ("QgeluMlp", mlp(qgelu), 0),
    **{f"{name}_mlp": (f"{name.capitalize()}Mlp", mlp(lambda t, g=gate: gated(t, g)), 0)
       for name, gate in GLU_GATES.items()},
    "situglu_mlp": ("SitugluMlp", mlp(lambda t: situglu(t, beta1=2.0, beta2=8.0)), 0),
    "l2norm_block": ("L2normBlock", mlp(lambda t: l2_normalization(t, 1e-5)), 0),
    "residual_blocks": ("ResidualBlocks", residual_blocks, 0),
    "nested_residual": ("NestedResidual", nested_residual, 0),
}



def residual_any(p, x, r):
    s = (x + r) * 0.5
    return qgelu(s), s


# Size-generic pipelines (specs/size_generic.py): name -> (class name, reference, whether a GLU
# halves the width)
GENERIC_PIPELINES = {
    "gelu_any": ("GeluAny", lambda p, x: (F.gelu(x, approximate="tanh"),), False),
    "swiglu_any": ("SwigluAny", lambda p, x: (swiglu(x),), True),
    "residual_any": ("ResidualAny", residual_any, False),
    "glu_tee_any": ("GluTeeAny", lambda p, x: (swiglu(x) * 0.5, swiglu(x)), True),
    "glu_gelu_any": ("GluGeluAny", lambda p, x: (F.gelu(swiglu(x), approximate="tanh"), swiglu(x)), True),
}

# --- GEMMs of the large pipelines: the module's own weight, never a float64 copy -----------------
# A float64 copy of TeMlp's weights and their float64 grads would be 2.8 GB on top of the module's
# own 1.4 GB (fp32 weights and grads): the largest test's peak. Its weights are exact in float64
# as they stand, so the reference reads them a block of rows at a time, and keeps a weight's grad
# dW = dY^T X as its two small factors, formed a block of rows at a time where it is compared.

STREAMED = 1 << 24  # weights of at least this many elements are streamed (TeMlp's, Fc1's, Fc2's)
ROW_BLOCK_ELEMENTS = 1 << 22  # float64 elements of one block of a streamed weight's rows


class StreamedWeight:
    """A module's Linear weight as a reference's parameter: read a block of rows at a time (in
    float64, on ``device``); ``grad`` is its reference gradient once the reference's backward ran."""

    def __init__(self, weight, device="cpu"):
        self.weight, self.device = weight.detach(), device
        self.shape = self.weight.shape
        self.grad = None

    def blocks(self):
        """(first row, float64 rows) of the weight, a block at a time."""
        step = max(1, ROW_BLOCK_ELEMENTS // self.shape[1])
        for start in range(0, self.shape[0], step):
            yield start, self.weight[start:start + step].to(device=self.device, dtype=torch.float64)


class LinearWeightGrad:
    """A Linear's weight grad dW = dY^T X kept as its factors (float64 [tokens, out], [tokens, in])."""

    def __init__(self, dy, x):
        self.dy, self.x = dy, x
        self.shape = torch.Size((dy.shape[1], x.shape[1]))

    def rows(self, start, stop):
        return self.dy[:, start:stop].T @ self.x


class _StreamedLinear(torch.autograd.Function):
    """y = x W^T + b in float64 from a StreamedWeight: the output a block of W's rows at a time;
    backward gives dx = dY W (block by block), db, and W's grad as a LinearWeightGrad."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.w = w
        ctx.save_for_backward(x)
        y = torch.cat([x @ rows.T for _, rows in w.blocks()], dim=-1)
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        w = ctx.w
        assert w.grad is None, "a streamed weight used twice: its grad would need adding up"
        dx = torch.zeros_like(x)
        for start, rows in w.blocks():
            dx += dy[..., start:start + rows.shape[0]] @ rows
        flat_dy = dy.reshape(-1, dy.shape[-1])
        w.grad = LinearWeightGrad(flat_dy, x.reshape(-1, x.shape[-1]))
        return dx, None, flat_dy.sum(0) if ctx.needs_input_grad[2] else None


def rotate_half64(t, base):
    """Rotary on t [seq, heads, d] (one sequence, positions 0..seq-1): t cos + rotate_half(t) sin,
    rotate_half(t) = (-t[d/2:], t[:d/2]), frequencies base^(-2i/d) for each half's i."""
    seq, d = t.shape[0], t.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None, :], torch.cat([angles.sin()] * 2, -1)[:, None, :]
    rotated = torch.cat([-t[..., d // 2:], t[..., : d // 2]], dim=-1)
    return t * cos + rotated * sin


def attention64(qkv, lengths, heads, kv_heads, causal, rotary_base):
    """Self-attention of each packed sequence on its own: [total, (heads + 2 kv) d] → [total, heads d]."""
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    outputs, start = [], 0
    for n in lengths:
        piece = qkv[start:start + n]
        start += n
        q = piece[:, : heads * d].reshape(n, heads, d)
        k = piece[:, heads * d:(heads + kv_heads) * d].reshape(n, kv_heads, d)
        v = piece[:, (heads + kv_heads) * d:].reshape(n, kv_heads, d)
        if rotary_base is not None:
            q, k = rotate_half64(q, rotary_base), rotate_half64(k, rotary_base)
        group = heads // kv_heads  # query head h reads kv head h // group
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        if causal:
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(n, heads * d))
    return torch.cat(outputs) if outputs else qkv.new_zeros(0, heads * d)


def as64(t, device, requires_grad=False):
    """A float64 copy of ``t`` on ``device``: a new leaf, with ``requires_grad`` one of autograd's."""
    return t.detach().to(device=device, dtype=torch.float64).requires_grad_(requires_grad)


def reference_params(module, device, requires_grad):
    """The module's parameters for a reference: float64 copies (leaves with ``requires_grad``),
    the large weights as StreamedWeights."""
    return {k: StreamedWeight(v, device) if v.dim() == 2 and v.numel() >= STREAMED else as64(v, device, requires_grad)
            for k, v in module.state_dict().items()
            if k.rpartition(".")[2] != "_extra_state"}  # a TE module's extra state (TeModuleOp): no value


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def pipeline_tolerance(dtype, gemm=True):
    """4 units of roundoff of the dtype, relative to the tensor's max |ref|. With a GEMM, float32
    uses float16's roundoff (TF32 may run), as TE's single-op rows do."""
    return 4 * UNIT_ROUNDOFF[torch.float16 if dtype == torch.float32 and gemm else dtype]


CHUNK = 1 << 22  # elements compared at a time: a 117M-element weight grad needs no 1 GB copies


def assert_close_to_reference(name, got, ref, dtype, gemm=True):
    """Multi-op check: max |got - ref| <= 4 units of roundoff x max |ref|. Computed in float64,
    a chunk at a time (the same maxima as over the whole tensor, without whole float64 copies).
    ``ref`` is a tensor or a LinearWeightGrad (formed a block of rows at a time)."""
    got = got.detach()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = err = 0.0
    for got64, ref64 in _float64_chunks(got, ref):
        # max |.| from one min/max pass each (no |.| copy); a NaN or inf in got makes the
        # difference's extremes non-finite (aminmax propagates NaN), which max() would drop
        low, high = (v.item() for v in torch.aminmax(got64 - ref64))
        assert math.isfinite(low) and math.isfinite(high), f"{name}: non-finite values"
        err = max(err, -low, high)
        low, high = (v.item() for v in torch.aminmax(ref64))
        scale = max(scale, -low, high)
    tol = pipeline_tolerance(dtype, gemm) * max(scale, 1e-30)
    assert err <= tol, f"{name}: max |err| {err:.3e} > {tol:.3e} (max |ref| {scale:.3e}, {dtype})"


def _float64_chunks(got, ref):
    """Matching float64 CPU pieces of about CHUNK elements of ``got`` and ``ref``."""
    if isinstance(ref, LinearWeightGrad):
        step = max(1, CHUNK // ref.shape[1])
        for start in range(0, ref.shape[0], step):
            yield (got[start:start + step].to(device="cpu", dtype=torch.float64),
                   ref.rows(start, start + step).to(device="cpu", dtype=torch.float64))
        return
    got, ref = got.reshape(-1), ref.detach().cpu().reshape(-1)
    for start in range(0, got.numel(), CHUNK):
        yield got[start:start + CHUNK].to(device="cpu", dtype=torch.float64), ref[start:start + CHUNK].to(torch.float64)


def randomize_(module, generator=None):
    """Signed random parameters: zero biases and unit gammas would hide wrong gradients."""
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            if p.dtype == torch.float32 and p.is_contiguous() and p.device.type == "cpu":
                torch.randn(p.shape, generator=generator, out=p.data)  # the same draws, no temporary
                p.div_(fan_in**0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / fan_in**0.5)


def run_and_compare(module, name, x_shape, dtype, device, make_input=None, seed=0, ref_device="cpu",
                    reference=None, gemm=True, no_grad=None):
    """Forward + backward of a generated module against the float64 reference (computed on
    ``ref_device``; ``reference(params, x, *extra_inputs)``, by default the shipped pipeline's in
    PIPELINES); asserts every output, extra output, input grad and parameter grad. A size-generic
    module's extra inputs are as wide as its ``extra_input_features`` say in terms of x's width n.
    ``gemm=False``: the pipeline has no GEMM, so float32 is held to its own roundoff.
    ``no_grad``: a context (torch.no_grad, torch.inference_mode), or a tuple of them, the module
    runs under (its no-grad forward), each against one reference; outputs only."""
    if reference is None:
        _, reference, _ = PIPELINES[name]
    module.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(seed)
    rows_shape = x_shape[:-1]
    inputs = [torch.randn(x_shape, generator=gen)]
    widths = [eval(n, {"n": x_shape[-1]}) if isinstance(n, str) else n for n in module.extra_input_features]
    inputs += [torch.randn((*rows_shape, n), generator=gen) for n in widths]
    dev_inputs = [t.to(device=device, dtype=dtype) for t in inputs]
    if make_input is not None:
        dev_inputs = [make_input(t) for t in dev_inputs]
    dev_inputs = [t.requires_grad_() for t in dev_inputs]
    cuda = sorted({torch.device(d).index or 0 for d in (device, ref_device) if torch.device(d).type == "cuda"})
    if no_grad is not None:
        ref_outputs = None
        for mode in no_grad if isinstance(no_grad, tuple) else (no_grad,):
            with torch.random.fork_rng(devices=cuda), mode():  # each mode draws Dropout's keys anew
                outputs = module(*dev_inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            assert all(o.grad_fn is None for o in outputs)  # no graph (an extra output may be x itself)
            if ref_outputs is None:  # after the module, as a Dropout reference seeds torch's generator itself
                ref_outputs = reference(reference_params(module, ref_device, False),
                                        *[as64(t, ref_device) for t in dev_inputs])
            assert len(ref_outputs) == len(outputs)
            for i, (o, r) in enumerate(zip(outputs, ref_outputs)):
                assert o.dtype == dtype and o.device.type == torch.device(device).type
                assert_close_to_reference(f"{name} no-grad output {i} ({mode.__name__})", o, r, dtype, gemm)
        return

    # The float64 reference first, keeping only its results: its parameter copies are gone before
    # the module's own grads exist, and the large weights are never copied (StreamedWeight). It
    # leaves torch's random state as it found it: the module's Dropout draws come next.
    with torch.random.fork_rng(devices=cuda):
        params64 = reference_params(module, ref_device, True)
        inputs64 = [as64(t, ref_device, True) for t in dev_inputs]
        ref_outputs = reference(params64, *inputs64)
        grads = [torch.randn(r.shape, generator=gen).to(dtype) for r in ref_outputs]
        torch.autograd.backward(ref_outputs, [g.to(device=ref_device, dtype=torch.float64) for g in grads])
    ref_outputs = [r.detach() for r in ref_outputs]
    ref_input_grads = [t.grad for t in inputs64]
    ref_param_grads = {k: v.grad for k, v in params64.items()}
    del params64, inputs64

    outputs = module(*dev_inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert len(ref_outputs) == len(outputs)
    torch.autograd.backward(outputs, [g.to(device=device) for g in grads])

    for i, (o, r) in enumerate(zip(outputs, ref_outputs)):
        assert o.dtype == dtype and o.device.type == torch.device(device).type
        assert_close_to_reference(f"{name} output {i}", o, r, dtype, gemm)
    for i, (t, r) in enumerate(zip(dev_inputs, ref_input_grads)):
        assert_close_to_reference(f"{name} input grad {i}", t.grad, r, dtype, gemm)
    named = dict(module.named_parameters())
    assert set(named) == set(ref_param_grads)
    for key, p in named.items():
        assert p.grad is not None, f"{name}: no grad for {key}"
        assert_close_to_reference(f"{name} grad {key}", p.grad, ref_param_grads[key], dtype, gemm)


# --- Dropout: the documented counter-based draws, written again from their definition ------------

def _fmix32(h):
    """MurmurHash3's 32-bit finaliser on Python ints."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def dropout_keep(key, shape, p):
    """The keep mask Dropout(p) draws under ``key`` (a signed 64-bit int) for a value of ``shape``:
    element i (flat index) is kept when its 24-bit draw, as a multiple of 2**-24, is >= p."""
    import math

    key &= 2**64 - 1
    numel = math.prod(shape)
    keep = []
    for i in range(numel):
        h = _fmix32((i & 0xFFFFFFFF) ^ (key & 0xFFFFFFFF))
        h = _fmix32(h ^ (i >> 32) ^ (key >> 32))
        keep.append((h >> 8) >= math.ceil(p * 2**24))
    return torch.tensor(keep).reshape(shape)


def next_keys(count, device):
    """The keys the next ``count`` Dropout calls of a module draw from PyTorch's generator on
    ``device``, in forward order (call under the same torch.manual_seed as the module)."""
    return [torch.randint(-2**63, 2**63 - 1, (1,), dtype=torch.int64, device=device).item() for _ in range(count)]


# Modules whose inputs are not [rows, in_features]: class -> rows -> (x's shape, the extra inputs')
INPUT_SHAPES = {
    "Layernorm2d": lambda rows: ((rows, 7, 2), []),  # LayerNorm((7, 2)) normalises the last 2 dims
    "RmsnormGroups": lambda rows: ((rows, 4, 64), []),  # RMSNorm((4, 64)) likewise
    # Reshape((2, 3, -1)) then RMSNorm(64): 2 x 3 x 64 elements, whatever the rows
    "SplitNorm": lambda rows: ((6, 64), []),
    # Reshape((2, 3, -1)) makes a width of 2 * rows, which the SwiGLU halves for the extra input
    "SplitRows": lambda rows: ((rows, 12), [(2, 3, rows)]),
    # TE's attention modules read x as their qkv_format says, as TE does: "bshd" a 3-D x (one
    # sequence of all rows), "thd" packed tokens (one sequence without seq_lens)
    "TeGptAttention": lambda rows: ((1, rows, 256), []),
    "TeGptLayer": lambda rows: ((1, rows, 256), []),
    "TeGqaAttention": lambda rows: ((rows, 256), []),
    "TeLlamaLayer": lambda rows: ((rows, 256), []),
    # specs/te_models.py's: the GPT stacks read "sbhd" (x [seq, batch, hidden]), the TE Llama stack "thd"
    "TeGptStack": lambda rows: ((rows, 1, 256), []),
    "GptStack": lambda rows: ((rows, 1, 256), []),
    "TeLlamaStack": lambda rows: ((rows, 256), []),
    "LlamaLayerTe": lambda rows: ((rows, 4096), []),  # specs/llama_layer.py's te.TransformerLayer: "thd"
    "LlamaLayerTeFused": lambda rows: ((rows, 4096), []),  # the same with TE's one fused QKV weight
}


def replays_graphs_in(module_class, dtype):
    """Whether a generated module class replays CUDA graphs for inputs of ``dtype`` (made on the
    meta device: no parameter memory, no initialisation work)."""
    graphs = getattr(module_class(device="meta"), "cuda_graphs", None)
    return graphs is not None and (graphs.dtypes is None or dtype in graphs.dtypes)


def module_inputs(module, rows, gen, device="cuda", dtype=torch.float32):
    """x and the extra inputs of a generated module: a size-generic module at width 64, a per-row
    input (a row-scaled activation's scales) one positive value a row; INPUT_SHAPES' as they say."""
    if type(module).__name__ in INPUT_SHAPES:
        x_shape, extra = INPUT_SHAPES[type(module).__name__](rows)
        return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape in (x_shape, *extra)]
    n = module.in_features or 64
    tensors = [torch.randn(rows, n, generator=gen)]
    for e in module.extra_input_features:
        if e == "rows":
            tensors.append(torch.rand(rows, generator=gen) + 0.5)
        else:
            tensors.append(torch.randn(rows, e if isinstance(e, int) else eval(e, {"n": n}), generator=gen))
    return [t.to(device=device, dtype=dtype) for t in tensors]
