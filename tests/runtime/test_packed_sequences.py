"""The packed-sequence call forms every generated module takes (``m(x, seq_lens)``, ``seq_lens=``,
``max_seqlen=``; a 2-D x is one sequence, a 3-D x [batch, seq, hidden] batch sequences of seq), and
their plumbing to an op that reads them (``OpDef.reads_sequences``): a plugin op here, a
per-sequence mean subtraction scaled by 1 / max_seqlen, run as its reference math (the opaque
stage), so the offsets and the bound reach it as the pipeline's values, on CPU, end to end."""

import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

import generated
from fusegen import build, output
from references import assert_close_to_reference, module_names

PLUGIN = '''
from fusegen.plugins import OpDef, register_op


def sequence_centre(x, cu_seqlens, max_seqlen):
    """Each sequence's rows less their mean, times 1 / max_seqlen."""
    y = x.clone()
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            y[start:end] = x[start:end] - x[start:end].mean(0, keepdim=True)
    return y / max(max_seqlen, 1)


def sequence_centre_bwd(x, dy, cu_seqlens, max_seqlen):
    return (sequence_centre(dy, cu_seqlens, max_seqlen),)  # the map is a symmetric projection, scaled


SequenceCentre = register_op(OpDef(
    "SequenceCentre", "sequence_centre", reference=(sequence_centre, sequence_centre_bwd), opaque=True,
    reads_sequences=True, summary="each packed sequence less its mean, over 1 / max_seqlen"))
'''

SPEC = '''
import transformer_engine.pytorch as te
from seq_ops import SequenceCentre

packed = te.Sequential(te.Linear(8, 8, bias=False), SequenceCentre(), te.SiLU(), te.Linear(8, 4))
packed_extra = te.Sequential(te.Linear(8, 8, bias=False), SequenceCentre(), te.AddExtraInput())
plain = te.Sequential(te.Linear(8, 4), te.GELU())
'''


def packed_package(folder, package, archs=()):
    """The spec above, built with the plugin op (``archs``: the binaries' targets; none on CPU)."""
    (folder / "seq_ops.py").write_text(PLUGIN)
    (folder / "spec.py").write_text(SPEC)
    config = build.Config((folder / "spec.py",), folder / package, archs=archs, dtypes=("float32",), root=folder,
                          plugins=("seq_ops",))
    output.write_package(build.build_package(config), config.out)
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(package)
    finally:
        sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return packed_package(tmp_path_factory.mktemp("packed"), "packed_pkg")


def silu(x):
    return x / (1 + torch.exp(-x))


def centred(h, lengths, max_seqlen):
    """float64 reference: each sequence of ``lengths`` less its own mean, over max_seqlen."""
    pieces, start = [], 0
    for n in lengths:
        piece = h[start:start + n]
        pieces.append(piece - piece.mean(0, keepdim=True) if n else piece)
        start += n
    return torch.cat(pieces) / max(max_seqlen, 1)


def reference(p, x, lengths, max_seqlen):
    h = x @ p["0.weight"].t()  # (a bias here would have no effect: each sequence is centred)
    h = silu(centred(h, lengths, max_seqlen))
    return h @ p["3.weight"].t() + p["3.bias"]


def seeded(module):
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter))
    return module


def compare(module, call, x, lengths, max_seqlen):
    """Outputs and the grads of x and every parameter (float32) against the float64 reference."""
    xg, xr = x.clone().requires_grad_(), x.double().reshape(-1, x.shape[-1]).requires_grad_()
    p64 = {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}
    y = call(module, xg)
    want = reference(p64, xr, lengths, max_seqlen)
    assert_close_to_reference("y", y.reshape(want.shape), want.detach(), torch.float32)
    dy = torch.randn_like(want)
    grads = torch.autograd.grad(y, [xg, *module.parameters()], dy.float().reshape(y.shape))
    wants = torch.autograd.grad(want, [xr, *p64.values()], dy)
    for name, got, expected in zip(["x", *p64], grads, wants):
        assert_close_to_reference(f"d{name}", got.reshape(expected.shape), expected, torch.float32)
    with torch.no_grad():  # the no-grad forward takes them too
        assert_close_to_reference("no-grad y", call(module, x).reshape(want.shape), want.detach(), torch.float32)


LENGTHS = [1, 2, 0, 5, 3]  # a length 0 contributes nothing


@pytest.mark.parametrize("form", ["positional", "keyword", "int64", "with max_seqlen"])
def test_packed_call_forms_reach_the_op_as_offsets_and_the_longest_length(pkg, form):
    module = seeded(pkg.Packed(dtype=torch.float32))
    x = torch.randn(sum(LENGTHS), 8, dtype=torch.float32)
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int64 if form == "int64" else torch.int32)
    calls = {
        "positional": (lambda m, t: m(t, seq_lens), max(LENGTHS)),
        "keyword": (lambda m, t: m(t, seq_lens=seq_lens), max(LENGTHS)),
        "int64": (lambda m, t: m(t, seq_lens), max(LENGTHS)),
        "with max_seqlen": (lambda m, t: m(t, seq_lens, max_seqlen=16), 16),  # a bound: the op gets it as given
    }
    call, max_seqlen = calls[form]
    compare(module, call, x, LENGTHS, max_seqlen)


def test_a_2d_x_is_one_sequence_and_a_3d_x_batch_major_sequences(pkg):
    module = seeded(pkg.Packed(dtype=torch.float32))
    x2 = torch.randn(7, 8, dtype=torch.float32)
    compare(module, lambda m, t: m(t), x2, [7], 7)
    x3 = torch.randn(3, 4, 8, dtype=torch.float32)  # 3 sequences of 4 tokens, x3[b] the b-th
    compare(module, lambda m, t: m(t), x3, [4, 4, 4], 4)
    assert module(x3).shape == (3, 4, 4)


def test_a_pipeline_with_extra_inputs_takes_seq_lens_by_keyword(pkg):
    module = seeded(pkg.PackedExtra(dtype=torch.float32))
    x, residual = torch.randn(6, 8, dtype=torch.float32), torch.randn(6, 8, dtype=torch.float32)
    seq_lens = torch.tensor([2, 4])
    p = {name: p.detach().double() for name, p in module.named_parameters()}
    want = centred(x.double() @ p["0.weight"].t(), [2, 4], 4) + residual.double()
    assert_close_to_reference("y", module(x, residual, seq_lens=seq_lens).detach(), want, torch.float32)
    with pytest.raises(TypeError):  # no positional seq_lens where the pipeline has extra inputs
        module(x, residual, seq_lens)


def test_a_pipeline_that_reads_no_sequences_accepts_and_ignores_them(pkg):
    module = seeded(pkg.Plain(dtype=torch.float32))
    x = torch.randn(5, 8, dtype=torch.float32)
    want = module(x)
    torch.testing.assert_close(module(x, torch.tensor([2, 3])), want, rtol=0, atol=0)
    torch.testing.assert_close(module(x, seq_lens=torch.tensor([1.5]), max_seqlen=3), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"Plain: seq_lens was given with a 3-D x \[1, 5, 8\]; packed sequences "
                                         r"take x \[total_tokens, hidden\]"):
        module(x[None], torch.tensor([5]))


def test_every_generated_module_takes_the_call_form_and_only_attentions_compute_it(pkg):
    modules = [getattr(generated, name) for name in module_names(generated)]
    modules += [pkg.Packed, pkg.PackedExtra, pkg.Plain]
    assert len(modules) > 40
    for module in modules:
        parameters = inspect.signature(module.forward).parameters
        tensors = [p for name, p in parameters.items() if name != "self" and p.default is inspect.Parameter.empty]
        seq_lens, max_seqlen = parameters["seq_lens"], parameters["max_seqlen"]
        assert seq_lens.default is None and max_seqlen.default is None, module.__name__
        assert max_seqlen.kind is inspect.Parameter.KEYWORD_ONLY, module.__name__
        # positional m(x, seq_lens) only where x is the only tensor the caller hands
        want = inspect.Parameter.POSITIONAL_OR_KEYWORD if len(tensors) == 1 else inspect.Parameter.KEYWORD_ONLY
        assert seq_lens.kind is want, module.__name__
    # only the pipelines with an op that reads sequences (attention: specs/attention_block.py) compute
    # them; every other module ignores them (no cost)
    computing = {path.name for path in Path(generated.__file__).parent.glob("*.py")
                 if "packed_sequences" in path.read_text() and not path.name.startswith("_")}
    with_attention = {path.name for path in Path(generated.__file__).parent.glob("*.py")
                      if "ref.flash_attention_forward(" in path.read_text()}
    assert computing == with_attention == {"attention_block.py", "mha_block.py", "mqa_block.py", "llama_layer.py",
                                           "llama_layer_te.py", "llama_layer_te_fused.py",  # specs/llama_layer.py
                                           "te_gpt_attention.py", "te_gqa_attention.py",  # specs/te_attention.py
                                           "te_gpt_layer.py", "te_llama_layer.py",  # specs/te_transformer_layer.py
                                           "te_gpt_stack.py", "gpt_stack.py", "te_llama_stack.py",
                                           "llama_stack.py",  # specs/te_models.py
                                           "tp_layer.py", "tp_te_layer.py", "tp_te_layer_sbhd.py"}  # specs/tensor_parallel.py
    # TE's per-call rotary table (forward(rotary_pos_emb=...)): the pipelines whose attention ops read
    # a qkv_format (TE's modules, gpt_stack's te.ops) and rotate by no rotary_base of their own
    tables = {path.name for path in Path(generated.__file__).parent.glob("*.py")
              if "ref.rotary_table_argument(" in path.read_text()}
    assert tables == {"te_gpt_attention.py", "te_gqa_attention.py", "te_gpt_layer.py", "te_llama_layer.py",
                      "te_gpt_stack.py", "gpt_stack.py", "te_llama_stack.py", "llama_layer_te.py",
                      "llama_layer_te_fused.py", "tp_te_layer.py", "tp_te_layer_sbhd.py"}
    assert "packed_sequences(" in Path(pkg.__file__).with_name("packed.py").read_text()
    assert "packed_sequences(" not in Path(pkg.__file__).with_name("plain.py").read_text()


@pytest.mark.parametrize("seq_lens, max_seqlen, error, message", [
    (torch.tensor([2.0, 5.0]), None, TypeError,
     r"Packed: seq_lens must have dtype int32 or int64 .*, got torch.float32"),
    (torch.tensor([3, -1, 5]), None, ValueError, r"Packed: seq_lens holds a negative length \(-1\)"),
    (torch.tensor([], dtype=torch.int32), None, ValueError,
     r"Packed: seq_lens must be 1-D \[batch\] .* got shape \[0\]"),
    (torch.tensor([2, 3]), None, ValueError, r"Packed: seq_lens sums to 5 tokens but x's rows are 7"),
    (torch.tensor([[3, 4]]), None, ValueError, r"Packed: seq_lens must be 1-D \[batch\]"),
    ([3, 4], None, TypeError, r"Packed: seq_lens must be a torch.Tensor .* got list"),
    (torch.tensor([3, 4]), 3, ValueError, r"Packed: max_seqlen=3 is less than the longest of seq_lens, 4"),
    (torch.tensor([3, 4]), 2.5, TypeError, r"Packed: max_seqlen must be None or an int of 0 or more"),
])
def test_bad_packed_sequences_are_clear_errors(pkg, seq_lens, max_seqlen, error, message):
    module = pkg.Packed(dtype=torch.float32)
    x = torch.randn(7, 8, dtype=torch.float32)
    with pytest.raises(error, match=message):
        module(x, seq_lens, max_seqlen=max_seqlen)


def test_a_3d_x_with_seq_lens_and_a_short_bound_are_errors(pkg):
    module = pkg.Packed(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"Packed: seq_lens was given with a 3-D x \[2, 3, 8\]"):
        module(torch.randn(2, 3, 8, dtype=torch.float32), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match=r"Packed: max_seqlen=2 is less than x's sequence length, 3"):
        module(torch.randn(2, 3, 8, dtype=torch.float32), max_seqlen=2)
    with pytest.raises(ValueError, match=r"Packed: x must be 2-D \[tokens, hidden\] .* got \[8\]"):
        module(torch.randn(8, dtype=torch.float32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_with_device_and_cpu_seq_lens(tmp_path):
    major, minor = torch.cuda.get_device_capability()
    gpu_pkg = packed_package(tmp_path, "packed_gpu_pkg", archs=(f"sm_{major}{minor}",))
    module = seeded(gpu_pkg.Packed(dtype=torch.float32, device="cuda"))
    x = torch.randn(sum(LENGTHS), 8, device="cuda")
    lengths = torch.tensor(LENGTHS, device="cuda")
    # at a few rows on a GPU (at most module.cuda_graphs.max_rows) the bound the op gets is the rows,
    # whatever the lengths and max_seqlen (one CUDA graph per row and batch count; no sync)
    rows = sum(LENGTHS)
    assert rows <= module.cuda_graphs.max_rows
    compare(module, lambda m, t: m(t, lengths), x, LENGTHS, rows)
    compare(module, lambda m, t: m(t, lengths, max_seqlen=9), x, LENGTHS, rows)
    compare(module, lambda m, t: m(t, lengths.cpu().int()), x, LENGTHS, rows)
    compare(module, lambda m, t: m(t), torch.randn(2, 5, 8, device="cuda"), [5, 5], 5)
    # above them, the longest length: read from a device seq_lens (a sync), or max_seqlen as given
    many = [70, 0, 61, 9]
    xm, lengths_m = torch.randn(sum(many), 8, device="cuda"), torch.tensor(many, device="cuda")
    assert sum(many) > module.cuda_graphs.max_rows
    compare(module, lambda m, t: m(t, lengths_m), xm, many, max(many))
    compare(module, lambda m, t: m(t, lengths_m, max_seqlen=90), xm, many, 90)  # no sync: checked on the device
    compare(module, lambda m, t: m(t, lengths_m.cpu().int()), xm, many, max(many))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="seq_lens is on cuda:1 but x on cuda:0"):
            module(x, lengths.to("cuda:1"))


def test_the_ignored_call_form_compiles_without_graph_breaks(pkg):
    module = seeded(pkg.Plain())
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = module(x)
        torch.testing.assert_close(compiled(x, torch.tensor([2, 3]), max_seqlen=3), want, rtol=0, atol=0)
        torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)
    y = compiled(x.requires_grad_(), torch.tensor([5]))  # under autograd too
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_the_sequences_compile_without_graph_breaks_given_max_seqlen(pkg):
    from packed_pkg._runtime import packed_sequences  # (the fixture's package is imported by then)

    def sequences(x, seq_lens):
        return packed_sequences("Packed", x, seq_lens, 8)

    compiled = torch.compile(sequences, fullgraph=True, backend="eager")
    x = torch.randn(11, 8)
    for seq_lens in (torch.tensor(LENGTHS), torch.tensor(LENGTHS, dtype=torch.int32)):
        cu_seqlens, max_seqlen = compiled(x, seq_lens)
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 1, 3, 3, 8, 11] and max_seqlen == 8
    with pytest.raises(RuntimeError, match="seq_lens must be lengths of 0 or more summing to x's 11 rows"):
        compiled(x, torch.tensor([1, 2, 3]))  # checked on the device (here the CPU) without a guard
