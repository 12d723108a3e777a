"""The op registry (generator/ops): every op's reference math is shipped by source into the
output's ``_reference.py`` and is the same code there; the registry imports no torch; every op with
a device functor has reference math and a functor in templates/cuda/activations.cuh."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from fusegen import ops
from fusegen.eager import bind_args
from fusegen.ops import OPS, OpDef, shipped
from fusegen.ops.common import COMMON
from fusegen.wrap import wrap_python

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "generated" / "_reference.py"


def load_shipped(path: Path = SHIPPED):
    """_reference.py imported on its own, as a plain module outside any package."""
    spec = importlib.util.spec_from_file_location("shipped_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_reference_is_current_and_defines_every_reference_function():
    assert SHIPPED.read_text() == wrap_python(ops.reference_source()), \
        "generated/_reference.py is stale: run fusegen generate"
    module = load_shipped()
    assert module.torch is torch  # a real import, nothing lazy
    for op in OPS.values():
        for fn in (*COMMON, *shipped.shipped_functions(op)):
            there = getattr(module, fn.__name__, None)
            assert there is not None and there.__code__.co_code == fn.__code__.co_code, f"{op.name}: {fn.__name__}"
    assert "lazy" not in SHIPPED.read_text()


def test_templates_call_only_the_common_helpers_by_fixed_name():
    """Per-op reference functions are called through the names their OpDef gives (kernels._step)."""
    fixed = set()
    for template in (ROOT / "templates").rglob("*.j2"):  # family folders (their reference macros) too
        fixed |= set(re.findall(r"\bref\.(\w+)", template.read_text()))
    assert fixed <= {fn.__name__ for fn in COMMON}, fixed


def test_every_functor_op_has_reference_math_and_a_device_functor():
    header = (ROOT / "templates" / "cuda" / "activations.cuh").read_text()
    functor_ops = [op for op in OPS.values() if op.device_struct]
    assert {op.name for op in functor_ops} >= {"GELU", "SwiGLU", "ClampedSwiGLU", "ConstantScale"}
    for op in functor_ops:
        forward, backward = op.reference
        assert callable(forward) and callable(backward), f"{op.name} has no reference forward and backward"
        namespace, struct = op.device_struct.split("::")
        # a functor spelled with <Math> is a template on the kernel's precision, the others are not
        name, templated = struct.removesuffix("<Math>"), struct.endswith("<Math>")
        declared = rf"template <typename Math>\s+struct {name}\b" if templated else rf"^struct {name}\b"
        assert namespace == "fg" and re.search(declared, header, re.MULTILINE), \
            f"{op.device_struct} is not in activations.cuh"


# --- the functions as called in generator/ops and as shipped: the same results -------------------

SAMPLE_ARGS = {"ConstantScale": (0.5,), "Bias": (8,), "Dropout": (0.25,)}  # ops whose arguments have no default


def reference_calls(op: OpDef, x, dy):
    """(function, args) pairs exercising ``op``'s reference forward and backward."""
    forward, backward = op.reference
    if op.functor_form == "binary":  # fwd(x, t, *constants), bwd(x, t, dy, *constants) -> (dx, dt)
        constants = op.device_args(bind_args(op, SAMPLE_ARGS.get(op.name, ()), {}))
        t = {"element": dy.flip(0), "column": dy[0], "scalar": dy[0, 0],
             "random": torch.rand(dy.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64),
             "row": dy[:, :1]}[op.operand.broadcast]
        return [(forward, (x, t, *constants)), (backward, (x, t, dy, *constants))]
    if op.functor_form == "tee":
        return [(forward, (x,))]
    if op.functor_form is not None:  # fwd(x, *constants), bwd(x, dy, *constants)
        constants = op.device_args(bind_args(op, SAMPLE_ARGS.get(op.name, ()), {}))
        dy = dy[:, : x.shape[1] // 2] if op.kind == "glu" else dy
        return [(forward, (x, *constants)), (backward, (x, dy, *constants))]
    if op.kind == "attention":  # f(x, cu_seqlens, *constants), f_bwd(x, dy, cu_seqlens, *constants)
        args = bind_args(op, (8, 1, 1) if op.name == "GroupedQueryAttention" else (8, 1), {"rotary_base": 100.0})
        qkv, sequences = torch.cat([x, x.flip(0), -x], dim=1), torch.tensor([0, 2, 5], dtype=torch.int32)
        constants = op.reference_arguments(args)
        return [(forward, (qkv, sequences, *constants)), (backward, (qkv, dy, sequences, *constants))]
    w, b = torch.randn(6, 8, dtype=x.dtype), torch.randn(8, dtype=x.dtype)
    if op.name == "BasicLinear":
        return [(forward, (x, w)), (backward, (dy[:, :6], x, w))]
    if op.name == "LayerNorm":
        _, mean, rstd = forward(x, b, b, 1e-5, True)
        return [(forward, (x, b, b, 1e-5, True)), (backward, (dy, x, mean, rstd, b, True))]
    if op.name == "L2Normalization":
        return [(forward, (x, 1e-6)), (backward, (x, dy, 1e-6))]
    if op.name == "RMSNorm":
        _, rstd = forward(x, b, 1e-5, False)
        return [(forward, (x, b, 1e-5, False)), (backward, (dy, x, rstd, b, False))]
    raise AssertionError(f"{op.name}: add its reference calls here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_and_shipped_reference_functions_agree(dtype):
    module = load_shipped()
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(5, 8, generator=gen)).to(dtype)
    dy = torch.randn(5, 8, generator=gen).to(dtype)
    for op in OPS.values():
        if op.reference == (None, None):
            continue
        for fn, args in reference_calls(op, x, dy):
            got, want = fn(*args), getattr(module, fn.__name__)(*args)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            same = len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
            assert same, f"{op.name}: {fn.__name__} differs between generator/ops and _reference.py"


# --- register refuses reference math that could not be shipped -------------------------------------

SCALE = 2.0


def reads_a_constant(x):
    return x * SCALE


def _double(x):
    return 2 * x


def calls_a_helper(x):
    return _double(x)


def gelu(x):  # the name of GELU's forward
    return x


def make_closure(k):
    def scaled(x):
        return x * k

    return scaled


@pytest.mark.parametrize("reference, helpers, problem", [
    ((reads_a_constant, None), (), "reads 'SCALE'"),
    ((calls_a_helper, None), (), "reads '_double'"),
    ((make_closure(2.0), None), (), "not a module-level def"),
    ((lambda x: x, None), (), "not a module-level def"),
    ((gelu, None), (), "the name of another op's reference function"),
])
def test_unshippable_reference_math_is_refused(reference, helpers, problem):
    op = OpDef("Probe", "activation", reference=reference, reference_helpers=helpers)
    with pytest.raises(ValueError, match=problem):
        shipped.check_shippable(op, OPS.values())


def test_declared_helpers_ship_with_their_op():
    op = OpDef("Probe", "activation", reference=(calls_a_helper, None), reference_helpers=(_double,))
    shipped.check_shippable(op, OPS.values())
    source = shipped.reference_source([*OPS.values(), op])
    assert source.index("def _double(") < source.index("def calls_a_helper(")
    with pytest.raises(ValueError, match="registered twice"):
        ops.register(OPS["GELU"])


def test_registry_order_is_the_family_order():
    """OPS iterates in registration order (ops.FAMILIES): generated files list ops in this order."""
    assert list(OPS) == ["BasicLinear", "Linear", "Bias", "LayerNorm", "RMSNorm", "L2Normalization", "GELU", "ReLU", "SiLU", "SReLU",
                         "QGELU", "SwiGLU", "GEGLU", "ClampedSwiGLU", "GLU", "QGEGLU", "ReGLU", "SReGLU", "SiTUGLU",
                         "RowScale", "ScaledSwiGLU", "ScaledSReLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU",
                         "ConstantScale", "Dropout", "AddExtraInput", "MakeExtraOutput", "Identity", "Quantize", "Reshape", "FlattenRows",
                         "UnflattenRows",
                         "MultiHeadedSelfAttention", "GroupedQueryAttention", "MultiQuerySelfAttention",
                         "AllGather", "ReduceScatter", "AllReduce", "TensorParallelCopy", "nn.Linear",
                         "nn.LayerNorm", "nn.RMSNorm", "nn.GELU", "nn.SiLU", "nn.ReLU", "nn.Dropout", "nn.Identity",
                         "LayerNormLinear", "LayerNormMLP", "MultiheadAttention", "TransformerLayer", "Module"]
    assert [m.__name__.rpartition(".")[2] for m in ops.FAMILIES] == [
        "linear", "bias", "norms", "activations", "glu", "row_scaled", "scale", "dropout", "extra_io", "identity",
        "attention", "collectives", "torch_nn", "te_modules", "te_layer", "module"]
