"""TE's monolithic modules as macros (issue 39): te.LayerNormLinear and te.LayerNormMLP in a spec
expand to te.ops basic ops, keep TE's parameter names and shapes, and compute TE's documented
semantics. The references below are written from TE's docs (module docstrings of
transformer_engine/pytorch/module/layernorm_linear.py and layernorm_mlp.py), in float64."""

import math

import pytest
import torch

from fusegen import eager
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from tests.references import assert_close_to_reference, linear, randomize_, run_and_compare
from tests.spec_packages import imported_package

HEAD = "import torch\nimport transformer_engine.pytorch as te\n"


# --- independent float64 references of TE's documented semantics --------------------------------

def _norm(p, x, normalization, zero_centered_gamma, eps=1e-5):
    gamma = p["layer_norm_weight"] + 1 if zero_centered_gamma else p["layer_norm_weight"]  # TE stores gamma - 1
    if normalization == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gamma + p["layer_norm_bias"]


def _gelu_tanh(t):  # TE's gelu: the tanh approximation
    return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))


# TE's activations: a gated one reads fc1's output as [a | b] and gives act(a) * b
ACT = {"gelu": _gelu_tanh, "relu": torch.relu, "silu": lambda t: t * torch.sigmoid(t),
       "qgelu": lambda t: t * torch.sigmoid(1.702 * t), "srelu": lambda t: torch.relu(t) ** 2}
GATED = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu", "sreglu": "srelu"}


def _activation(name, t):
    if name in GATED:
        a, b = t.chunk(2, dim=-1)
        return ACT[GATED[name]](a) * b
    return ACT[name](t)


def _linear(x, w, b):
    return linear(x, w, b)  # F.linear, or a streamed large weight


def layernorm_mlp_reference(normalization, activation, zero_centered_gamma, bias, return_ln=False):
    def reference(p, x):
        q = {k.removeprefix("0."): v for k, v in p.items()}
        ln = _norm(q, x, normalization, zero_centered_gamma)
        h = _activation(activation, _linear(ln, q["fc1_weight"], q.get("fc1_bias")))
        y = _linear(h, q["fc2_weight"], q.get("fc2_bias"))
        return (y, ln) if return_ln else (y,)
    return reference


def layernorm_linear_reference(normalization, zero_centered_gamma, bias, return_ln):
    def reference(p, x):
        q = {k.removeprefix("0."): v for k, v in p.items()}
        ln = _norm(q, x, normalization, zero_centered_gamma)
        y = _linear(ln, q["weight"], q.get("bias"))
        return (y, ln) if return_ln else (y,)
    return reference


# --- TE's parameter names and shapes --------------------------------------------------------------

# Every TE module's state_dict ends in its extra state: an empty uint8 tensor where FP8 never ran
# (transformer_engine/pytorch/module/base.py, TransformerEngineBaseModule.get_extra_state)
EXTRA_STATE = {"_extra_state": (0,)}


def te_layernorm_mlp_layout(hidden, ffn, normalization, activation, bias):
    """The state_dict TE's LayerNormMLP registers (transformer_engine/pytorch/module/layernorm_mlp.py,
    LayerNormMLP.__init__: layer_norm_weight; layer_norm_bias unless RMSNorm; fc1_weight [fc1 out,
    hidden] with fc1 out = 2 * ffn for geglu, glu, qgeglu, reglu, sreglu, swiglu, clamped_swiglu;
    fc1_bias, fc2_weight [hidden, ffn], fc2_bias where bias)."""
    fc1 = 2 * ffn if activation in ("geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu") else ffn
    layout = {"layer_norm_weight": (hidden,)}
    if normalization != "RMSNorm":
        layout["layer_norm_bias"] = (hidden,)
    layout["fc1_weight"] = (fc1, hidden)
    if bias:
        layout["fc1_bias"] = (fc1,)
    layout["fc2_weight"] = (hidden, ffn)
    if bias:
        layout["fc2_bias"] = (hidden,)
    return {**layout, **EXTRA_STATE}


def te_layernorm_linear_layout(in_features, out_features, normalization, bias):
    """TE's LayerNormLinear (transformer_engine/pytorch/module/layernorm_linear.py, __init__ with
    parameters_split=None: layer_norm_weight, layer_norm_bias unless RMSNorm, weight, bias)."""
    layout = {"layer_norm_weight": (in_features,)}
    if normalization != "RMSNorm":
        layout["layer_norm_bias"] = (in_features,)
    layout["weight"] = (out_features, in_features)
    if bias:
        layout["bias"] = (out_features,)
    return {**layout, **EXTRA_STATE}


MLP_CASES = [  # (normalization, activation, zero_centered_gamma, bias)
    ("LayerNorm", "gelu", False, True),
    ("RMSNorm", "swiglu", True, False),
    ("LayerNorm", "qgeglu", True, True),
    ("RMSNorm", "srelu", False, True),
]
LINEAR_CASES = [  # (normalization, zero_centered_gamma, bias, return_layernorm_output)
    ("LayerNorm", False, True, False),
    ("RMSNorm", True, False, False),
    ("LayerNorm", True, True, True),
]


def _mlp_spec(normalization, activation, zcg, bias, extra=""):
    return (HEAD + f"m = te.Sequential(te.LayerNormMLP(32, 48, bias={bias}, normalization={normalization!r}, "
            f"activation={activation!r}, zero_centered_gamma={zcg}{extra}))\n")


def _linear_spec(normalization, zcg, bias, return_ln):
    return (HEAD + f"m = te.Sequential(te.LayerNormLinear(32, 40, bias={bias}, normalization={normalization!r}, "
            f"zero_centered_gamma={zcg}, return_layernorm_output={return_ln}))\n")


@pytest.mark.parametrize("normalization, activation, zcg, bias", MLP_CASES)
def test_layernorm_mlp_matches_te_s_semantics_and_names(tmp_path, normalization, activation, zcg, bias):
    with imported_package(tmp_path, "spec.py", _mlp_spec(normalization, activation, zcg, bias), "pkg") as pkg:
        module = pkg.M()
        layout = te_layernorm_mlp_layout(32, 48, normalization, activation, bias)
        assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {f"0.{k}": v for k, v in layout.items()}
        assert list(module.state_dict()) == [f"0.{k}" for k in layout]  # TE's registration order
        randomize_(module)
        run_and_compare(module, "layernorm_mlp", (3, 5, 32), torch.float32, "cpu",
                        reference=layernorm_mlp_reference(normalization, activation, zcg, bias))


def test_layernorm_mlp_returns_the_norm_s_output_as_te(tmp_path):
    """return_layernorm_output=True: TE's (out, ln_out); here out and the pipeline's extra output."""
    spec = _mlp_spec("LayerNorm", "reglu", False, True, extra=", return_layernorm_output=True")
    with imported_package(tmp_path, "spec.py", spec, "pkg") as pkg:
        module = pkg.M()
        randomize_(module)
        run_and_compare(module, "layernorm_mlp", (9, 32), torch.float32, "cpu",
                        reference=layernorm_mlp_reference("LayerNorm", "reglu", False, True, return_ln=True))


@pytest.mark.parametrize("normalization, zcg, bias, return_ln", LINEAR_CASES)
def test_layernorm_linear_matches_te_s_semantics_and_names(tmp_path, normalization, zcg, bias, return_ln):
    with imported_package(tmp_path, "spec.py", _linear_spec(normalization, zcg, bias, return_ln), "pkg") as pkg:
        module = pkg.M()
        layout = te_layernorm_linear_layout(32, 40, normalization, bias)
        assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {f"0.{k}": v for k, v in layout.items()}
        randomize_(module)
        run_and_compare(module, "layernorm_linear", (7, 32), torch.float32, "cpu",
                        reference=layernorm_linear_reference(normalization, zcg, bias, return_ln))


def test_zero_centered_gamma_is_stored_as_gamma_minus_one(tmp_path):
    """TE's zero_centered_gamma: layer_norm_weight initialised to 0 and applied as 1 + weight."""
    with imported_package(tmp_path, "spec.py", _linear_spec("LayerNorm", True, False, False), "pkg") as pkg:
        module = pkg.M()
        assert torch.equal(module.state_dict()["0.layer_norm_weight"], torch.zeros(32))
        x = torch.randn(4, 32)
        with torch.no_grad():
            module.get_submodule("0").weight.copy_(torch.eye(40, 32))
            y = module(x)
        # gamma = 1 + 0, beta = 0, bias = 0: y is the normalised x through the identity-like weight
        want = torch.nn.functional.layer_norm(x.double(), (32,)) @ torch.eye(40, 32, dtype=torch.float64).t()
        assert_close_to_reference("zcg", y, want, torch.float32)


def _te_checkpoint(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    return {f"0.{k}": torch.empty(0, dtype=torch.uint8) if k == "_extra_state" else torch.randn(shape, generator=gen)
            for k, shape in layout.items()}


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_a_state_dict_with_te_s_names_loads_into_the_generated_and_the_eager_module(tmp_path, kind):
    if kind == "mlp":
        spec, layout = _mlp_spec("RMSNorm", "swiglu", True, True), te_layernorm_mlp_layout(32, 48, "RMSNorm", "swiglu", True)
        eager_model = eager.Sequential(eager.LayerNormMLP(32, 48, normalization="RMSNorm", activation="swiglu",
                                                          zero_centered_gamma=True))
        reference = layernorm_mlp_reference("RMSNorm", "swiglu", True, True)
    else:
        spec, layout = _linear_spec("LayerNorm", False, True, False), te_layernorm_linear_layout(32, 40, "LayerNorm", True)
        eager_model = eager.Sequential(eager.LayerNormLinear(32, 40))
        reference = layernorm_linear_reference("LayerNorm", False, True, False)
    checkpoint = _te_checkpoint(layout, seed=3)
    with imported_package(tmp_path, "spec.py", spec, "pkg") as pkg:
        module = pkg.M()
        module.load_state_dict(checkpoint)  # strict: every key TE's, no other
        eager_model.load_state_dict(checkpoint)
        assert list(module.state_dict()) == list(eager_model.state_dict()) == list(checkpoint)
        x = torch.randn(6, 32, dtype=torch.float64)
        want = reference({k: v.double() for k, v in checkpoint.items()}, x)[0]
        assert_close_to_reference("generated", module(x.float()), want, torch.float32)
        assert_close_to_reference("eager", eager_model(x.float()), want, torch.float32)


def test_the_eager_modules_name_their_parameters_as_te_and_return_the_norm_s_output():
    mlp = eager.LayerNormMLP(16, 24, activation="geglu", params_dtype=torch.float64)
    assert {k: tuple(v.shape) for k, v in mlp.state_dict().items()} == te_layernorm_mlp_layout(
        16, 24, "LayerNorm", "geglu", True)
    assert all(p.dtype == torch.float64 for p in mlp.parameters())
    lnl = eager.LayerNormLinear(16, 8, return_layernorm_output=True)
    x = torch.randn(3, 16)
    y, ln = lnl(x)  # TE's (out, ln_out)
    assert_close_to_reference("ln_out", ln, torch.nn.functional.layer_norm(x.double(), (16,)), torch.float32, gemm=False)
    assert y.shape == (3, 8)


def test_a_checkpoint_with_te_s_fp8_state_is_refused_with_what_to_do(tmp_path):
    layout = te_layernorm_linear_layout(32, 40, "LayerNorm", True)
    checkpoint = {**_te_checkpoint(layout, seed=1), "0._extra_state": torch.ones(8, dtype=torch.uint8)}
    with imported_package(tmp_path, "spec.py", _linear_spec("LayerNorm", False, True, False), "pkg") as pkg:
        for model in (pkg.M(), eager.Sequential(eager.LayerNormLinear(32, 40))):
            with pytest.raises(RuntimeError, match="FP8 scaling state .* strict=False"):
                model.load_state_dict(checkpoint)
            del checkpoint["0._extra_state"]
            model.load_state_dict(checkpoint, strict=False)  # what the error says to do
            assert torch.equal(model.state_dict()["0.weight"], checkpoint["0.weight"])
            checkpoint["0._extra_state"] = torch.ones(8, dtype=torch.uint8)


def test_plan_shows_the_expansion_then_the_fusion(tmp_path):
    from fusegen import build
    (tmp_path / "spec.py").write_text(_mlp_spec("RMSNorm", "swiglu", False, False))
    config = build.Config((tmp_path / "spec.py",), tmp_path / "pkg", archs=(), dtypes=("float32",), root=tmp_path)
    plan = build.plan_documents(config)["m"]
    assert ("| 0a | `RMSNorm(32)`: `LayerNormMLP(32, 48, bias=False, normalization='RMSNorm', activation='swiglu')`, "
            "its layer_norm |") in plan
    for row in ("| 0b | `BasicLinear(32, 96)`: its fc1 |", "| 0c | `SwiGLU()`: its activation |",
                "| 0d | `BasicLinear(48, 32)`: its fc2 |"):
        assert row in plan
    assert "| 0 | 0a | `norm`" in plan  # then planned as any spec


def _stage_rows(plan_md):
    """The plan's stage tables (forward, no-grad, backward) without their op numbers: (rule, runs
    as, bytes/token) per stage."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in plan_md.splitlines()
            if line.startswith("| ")]
    return [row[2:] for row in rows if len(row) == 5 and row[0].isdigit()]


@pytest.mark.parametrize("module, chain", [
    ("te.LayerNormMLP(64, 128, bias=False, normalization='RMSNorm', activation='swiglu')",
     "te.ops.RMSNorm(64), te.ops.Linear(64, 256, bias=False), te.ops.SwiGLU(), te.ops.Linear(128, 64, bias=False)"),
    ("te.LayerNormMLP(64, 96, zero_centered_gamma=True)",
     "te.ops.LayerNorm(64, zero_centered_gamma=True), te.ops.Linear(64, 96), te.ops.GELU(), te.ops.Linear(96, 64)"),
    ("te.LayerNormLinear(64, 32, normalization='RMSNorm', eps=1e-6)",
     "te.ops.RMSNorm(64, eps=1e-6), te.ops.Linear(64, 32)"),
])
def test_a_te_module_plans_as_the_hand_written_chain_of_its_ops(tmp_path, module, chain):
    from fusegen import build
    (tmp_path / "spec.py").write_text(HEAD + f"a = te.Sequential({module})\nb = te.ops.Sequential({chain})\n")
    config = build.Config((tmp_path / "spec.py",), tmp_path / "pkg", archs=(), dtypes=("float32",), root=tmp_path)
    plans = build.plan_documents(config)
    assert _stage_rows(plans["a"]) == _stage_rows(plans["b"]) and len(_stage_rows(plans["a"])) >= 4


def error(text):
    with pytest.raises(SpecError) as info:
        parse_spec(HEAD + text, "spec.py")
    return info.value


@pytest.mark.parametrize("call, at, says", [
    ("te.LayerNormMLP(32, 48, tp_size=0)", "0", "must be positive"),
    ("te.LayerNormLinear(32, 48, parallel_mode='row')", "'row'", "a norm before a row-parallel GEMM reads whole rows"),
    ("te.LayerNormMLP(32, 48, activation='tanh')", "'tanh'", "must be one of TE's activations: gelu, geglu"),
    ("te.LayerNormMLP(32, 48, normalization='BatchNorm')", "'BatchNorm'", "must be 'LayerNorm' or 'RMSNorm'"),
    ("te.LayerNormMLP(32, 48, return_bias=True)", "True", "returns the bias unadded"),
    ("te.LayerNormMLP(32, 48, activation_params={'limit': 5.0})", "{", "unsupported expression in argument 'activation_params'"),
    ("te.LayerNormMLP(32, 48, delay_wgrad_compute=True)", "True", "backward_dw"),
    # (a tuple's place: its first element, or its closing parenthesis where it has none)
    ("te.LayerNormLinear(32, 48, parameters_split=('q', 'q'))", "'q', 'q'", "must name distinct parameters"),
    ("te.LayerNormLinear(32, 48, parameters_split=())", "))", "must be a tuple of names"),
    ("te.LayerNormLinear(32, 48, parameters_split=('layer_norm_',))", "'layer_norm_'", "must not name 'layer_norm'"),
    ("te.LayerNormLinear(32, 48, parameters_split={'q': 48})", "{", "unsupported expression in argument "
     "'parameters_split'"),
    ("te.LayerNormLinear(32, 48, eps=0.0)", "0.0", "must be positive"),
])
def test_bad_arguments_are_refused_where_they_are_written(call, at, says):
    """Each error points at the value given (the binder's place for a value's error)."""
    err = error(f"m = te.Sequential({call})\n")
    assert says in err.message, err.message
    assert (err.location.line, err.location.col) == (3, 19 + call.rindex(at)), str(err)


@pytest.mark.parametrize("call, says", [
    ("te.LayerNormLinear(32, 48, parameters_split=('a', 'b', 'c', 'd', 'e'))",
     "parameters_split splits out_features=48 into 5 equal blocks, which it is not a multiple of"),
    ("te.LayerNormLinear(32, 48, parameters_split=('a',), fuse_wgrad_accumulation=True)",
     "fuse_wgrad_accumulation=True adds the weight's grad into the one weight's main_grad"),
])
def test_parameters_split_against_the_other_arguments_is_refused_at_the_module(call, says):
    err = error(f"m = te.Sequential({call})\n")
    assert says in err.message, err.message
    assert (err.location.line, err.location.col) == (3, 19), str(err)


def test_parameters_split_holds_te_s_blocks_and_computes_the_whole_weight_s_function(tmp_path):
    """te.LayerNormLinear(parameters_split=(...)) (TE's layernorm_linear.py): the weight and bias as
    equal row blocks of one buffer named <name>_weight, <name>_bias (trailing underscores stripped),
    in the generated and the eager module; on their concatenation both compute what the unsplit
    module computes: output, x's grad and each block's grad its rows of the whole weight's, in
    float64 on the CPU."""
    spec = HEAD + ("split = te.Sequential(te.LayerNormLinear(64, 96, parameters_split=('query_', 'key_', 'value_')))\n"
                   "whole = te.Sequential(te.LayerNormLinear(64, 96))\n")
    blocks = ("query", "key", "value")
    with imported_package(tmp_path, "spec.py", spec, "pkg") as pkg:
        split, whole = pkg.Split(dtype=torch.float64), pkg.Whole(dtype=torch.float64)
        shapes = {k: tuple(v.shape) for k, v in split.state_dict().items() if not k.endswith("_extra_state")}
        assert shapes == {"0.layer_norm_weight": (64,), "0.layer_norm_bias": (64,),
                          **{f"0.{b}_weight": (32, 64) for b in blocks}, **{f"0.{b}_bias": (32,) for b in blocks}}
        model = eager.Sequential(eager.LayerNormLinear(64, 96, parameters_split=("query_", "key_", "value_"),
                                                       params_dtype=torch.float64))
        assert [k for k in model.state_dict() if not k.endswith("_extra_state")] == list(shapes)
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in split.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        state = split.state_dict()
        model.load_state_dict(state)
        whole.load_state_dict({
            **{k: v for k, v in whole.state_dict().items() if k.endswith("_extra_state")},
            "0.layer_norm_weight": state["0.layer_norm_weight"], "0.layer_norm_bias": state["0.layer_norm_bias"],
            "0.weight": torch.cat([state[f"0.{b}_weight"] for b in blocks]),
            "0.bias": torch.cat([state[f"0.{b}_bias"] for b in blocks])})
        x = torch.randn(2, 5, 64, generator=gen, dtype=torch.float64)
        dy = torch.randn(2, 5, 96, generator=gen, dtype=torch.float64)
        results = []
        for module in (split, model, whole):
            xi = x.clone().requires_grad_()
            y = module(xi)
            y.backward(dy)
            grads = dict(module.named_parameters())
            held = [grads[f"0.{b}_{attr}"] for attr in ("weight", "bias") for b in blocks] if module is not whole else []
            weight = torch.cat([g.grad for g in held[:3]]) if held else grads["0.weight"].grad
            bias = torch.cat([g.grad for g in held[3:]]) if held else grads["0.bias"].grad
            results.append((y.detach(), xi.grad, weight, bias))
        for got in results[:2]:
            for what, a, b in zip(("y", "dx", "dweight", "dbias"), got, results[2]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=what)


def test_the_eager_modules_refuse_the_same_arguments():
    with pytest.raises(ValueError, match="argument 'parallel_mode' of LayerNormLinear must be None or 'column'"):
        eager.LayerNormLinear(32, 48, parallel_mode="row")
    with pytest.raises(ValueError, match="must be one of TE's activations"):
        eager.LayerNormMLP(32, 48, activation="tanh")
    with pytest.raises(TypeError, match="unexpected keyword argument 'hidden'"):
        eager.LayerNormLinear(32, 48, hidden=3)


def test_no_op_hints_are_accepted_and_change_nothing():
    """TE's hints without effect on the values (ub_* without sequence parallelism, JIT warm-up sizes,
    name, checkpoint) are accepted; the expansion is the same."""
    plain = parse_spec(HEAD + "m = te.Sequential(te.LayerNormMLP(32, 48))\n", "spec.py")[0].calls[0]
    hinted = parse_spec(HEAD + "m = te.Sequential(te.LayerNormMLP(32, 48, ub_overlap_ag=True, ub_bulk_wgrad=True, "
                        "seq_length=128, micro_batch_size=2, name='mlp', checkpoint=True, "
                        "return_layernorm_output_gathered=True))\n", "spec.py")[0].calls[0]
    from fusegen.ops import basic_parts
    assert [(op.name, args, part) for op, args, part, _ in basic_parts("LayerNormMLP", plain.args)] == \
        [(op.name, args, part) for op, args, part, _ in basic_parts("LayerNormMLP", hinted.args)]


def test_positional_arguments_bind_in_te_s_order():
    """TE's modules take every argument positionally in TE's order (LayerNormLinear's 5th is
    fuse_wgrad_accumulation, after eps and sequence_parallel)."""
    (spec,) = parse_spec(HEAD + "m = te.Sequential(te.LayerNormLinear(32, 48, 1e-6, False, True))\n", "spec.py")
    args = spec.calls[0].args
    assert (args["eps"], args["sequence_parallel"], args["fuse_wgrad_accumulation"]) == (1e-6, False, True)


def _residual_reference(p, x):
    """x + LayerNormMLP(x) (RMSNorm, swiglu, no bias), then x + LayerNormLinear(x) (LayerNorm, bias)."""
    q = {k.removeprefix("0.0."): v for k, v in p.items() if k.startswith("0.0.")}
    h = x + layernorm_mlp_reference("RMSNorm", "swiglu", False, False)({f"0.{k}": v for k, v in q.items()}, x)[0]
    r = {k.removeprefix("1.0."): v for k, v in p.items() if k.startswith("1.0.")}
    return (h + layernorm_linear_reference("LayerNorm", False, True, False)({f"0.{k}": v for k, v in r.items()}, h)[0],)


def test_te_modules_in_residuals_nest_their_names_and_fuse_across(tmp_path):
    spec = HEAD + ("m = te.Sequential(\n"
                   "    te.ops.Residual(te.LayerNormMLP(32, 48, bias=False, normalization='RMSNorm', activation='swiglu')),\n"
                   "    te.ops.Residual(te.LayerNormLinear(32, 32)),\n)\n")
    with imported_package(tmp_path, "spec.py", spec, "pkg") as pkg:
        module = pkg.M()
        mlp = te_layernorm_mlp_layout(32, 48, "RMSNorm", "swiglu", False)
        linear = te_layernorm_linear_layout(32, 32, "LayerNorm", True)
        assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {
            **{f"0.0.{k}": v for k, v in mlp.items()}, **{f"1.0.{k}": v for k, v in linear.items()}}
        randomize_(module)
        run_and_compare(module, "te_residuals", (2, 3, 32), torch.float32, "cpu", reference=_residual_reference)


def test_fuse_wgrad_accumulation_is_te_ops_accumulate_into_main_grad(tmp_path):
    spec = HEAD + "m = te.Sequential(te.LayerNormLinear(32, 40, fuse_wgrad_accumulation=True))\n"
    with imported_package(tmp_path, "spec.py", spec, "pkg") as pkg:
        module = pkg.M()
        weight = module.get_submodule("0").weight
        weight.main_grad = torch.zeros(weight.shape)
        x = torch.randn(5, 32)
        module(x).sum().backward()
        ln = torch.nn.functional.layer_norm(x, (32,))
        assert_close_to_reference("main_grad", weight.main_grad, torch.ones(5, 40).t().double() @ ln.double(),
                                  torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["te_layernorm_mlp", "te_layernorm_linear"])
def test_the_shipped_te_module_specs_in_bf16_against_float64(kind):
    import generated
    module = getattr(generated, "TeLayernormMlp" if kind == "te_layernorm_mlp" else "TeLayernormLinear")(
        device="cuda", dtype=torch.bfloat16)
    randomize_(module)
    reference = (layernorm_mlp_reference("RMSNorm", "swiglu", False, False) if kind == "te_layernorm_mlp"
                 else layernorm_linear_reference("LayerNorm", True, True, False))
    run_and_compare(module, kind, (4, 64, 1024), torch.bfloat16, "cuda", reference=reference, ref_device="cuda")
