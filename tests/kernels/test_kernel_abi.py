"""One ABI per kernel (kernels.kernel_abi): the .cu signature and the Python launch tuple of every
shipped kernel are both rendered from it, so they agree parameter for parameter."""

import ast
import functools
import re
from pathlib import Path

import pytest

from fusegen import build
from fusegen import kernels as kn
from fusegen.config import load_config

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "generated"


def shipped_specs():
    config = load_config([], None, None, None, None, supported_archs=None, cwd=ROOT)
    unique, _ = build.collect_kernels(build.load_plans(config))
    return list(unique.values())


SPECS = shipped_specs()


@functools.cache
def launchers_tree():
    """generated/_kernels.py, parsed once for every spec's test."""
    return ast.parse((GENERATED / "_kernels.py").read_text())


@functools.cache
def launch_calls() -> dict[str, list[list[ast.expr]]]:
    """Every ``_NAME.launch(dtype, grid, block, (arguments), device)`` call's arguments in
    generated/_kernels.py, by the kernel object's name: one walk of the tree for every spec's test."""
    calls: dict[str, list[list[ast.expr]]] = {}
    for call in ast.walk(launchers_tree()):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "launch"
                and isinstance(call.func.value, ast.Name)):
            calls.setdefault(call.func.value.id, []).append(call.args)
    return calls


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_signature_and_launch_tuple_come_from_one_abi(spec):
    abi = kn.kernel_abi(spec)
    source = (GENERATED / "kernels" / f"{spec.name}.cu").read_text()
    # the kernel's entry points, every dtype's it is built for (and a norm forward's second,
    # _few_rows, where it has one), take the same
    signatures = re.findall(rf"{spec.name}_(?:bf16|fp16|fp32)(?:_few_rows)?\((.*?)\) {{", source, re.S)
    assert len(signatures) >= len(spec.kernel_family.built_dtypes(spec, ("bfloat16", "float16", "float32"))), spec.name
    for signature in signatures:
        declared = [re.sub(r"\s+", " ", p.strip()) for p in signature.split(",")]
        assert declared == [f"{p.ctype}{' __restrict__' if '*' in p.ctype else ''} {p.name}" for p in abi]
    # the Kernel's signature letters and every launch tuple: pointers as ints (0: not passed;
    # pointer(t): a Dropout key, None in eval mode), C ints as they are
    letters = "".join("p" if p.pointer else "i" for p in abi)
    tree = launchers_tree()
    kernels = {node.targets[0].id: node.value for node in tree.body
               if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
               and getattr(node.value.func, "id", None) == "Kernel"}
    kernel = kernels[f"_{spec.name.upper()}"]
    assert [ast.literal_eval(a) for a in kernel.args] == [spec.name, letters]
    # dynamic shared memory (a norm backward's partials, a column-tiled backward's lane sums), given
    # only where the kernel takes some;
    # the dtypes with a _few_rows entry (a norm forward's), only where some dtype has one
    keywords = {k.arg: ({e.attr for e in k.value.elts} if k.arg == "few_rows" else ast.literal_eval(k.value))
                for k in kernel.keywords}
    few_rows = {dtype for dtype, (_, _, itemsize) in kn.DTYPES.items() if spec.few_rows(itemsize)}
    assert keywords == ({"shared": spec.shared_bytes} if spec.shared_bytes else {}) | ({"few_rows": few_rows} if few_rows else {})
    random = {dict(step)["operand"] for step in dict(spec.context).get("steps", ()) if dict(step)["broadcast"] == "random"}
    if spec.ctx.get("amax"):  # an FP8 operand's producer: the float it keeps the amax in, or None
        random.add("amax")
    values = [("0" if not p.passed else p.name if not p.pointer else f"pointer({p.name})" if p.name in random
               else f"{p.name}.data_ptr()") for p in abi]
    # every K.launch(dtype, grid, block, (arguments), device) call of this kernel, as parsed
    launches = launch_calls().get(f"_{spec.name.upper()}", [])
    assert all(ast.unparse(args[-1]).endswith(".get_device()") for args in launches)
    arguments = [[ast.unparse(value) for value in args[3].elts] for args in launches]
    if spec.family == "norm_fwd":  # and its launcher for a forward without autograd: no statistics, a sum if kept
        no_grad = ["0" if p.name in ("mean", "rstd") else "residual_out.data_ptr() if keep_sum else 0"
                   if p.name == "residual_out" and p.passed else v for p, v in zip(abi, values)]
        assert len(arguments) == 2 and arguments[1] == no_grad
        arguments = arguments[:1]
    if spec.ctx.get("single_launch"):  # and its launch above a few rows, which leaves the grads to column_sum
        leaves_them = ["0" if p.name == "grads" else v for p, v in zip(abi, values)]
        assert len(arguments) == 2 and arguments[1] == leaves_them
        arguments = arguments[:1]
    if spec.family == "quantize":  # a cast's scale, amax and amax_out given or not (its launcher's random
        # operands), its transpose written only where asked; the delayed update's reduced amax given or not
        asked = {name: f"pointer({name})" for name in kn.launcher_io(spec)["random"]}
        if spec.ctx["kind"] == "cast":
            asked["y_t"] = "y_t.data_ptr() if transpose else 0"
        if spec.ctx["kind"] == "blocks":  # the row-wise copy and the transposed one, each where asked
            asked.update({name: f"{name}.data_ptr() if {flag} else 0" for name, flag in (
                ("y", "rows_out"), ("s", "rows_out"), ("y_t", "columns_out"), ("s_t", "columns_out"))})
        values = [asked.get(p.name, v) for p, v in zip(abi, values)]
    if spec.ctx.get("fp8_out"):  # an FP8 variant: its scale, amax and amax_out given or not, stores where asked
        out = spec.returned[0]
        asked = {"scale": "pointer(scale)", "amax": "pointer(amax)", "amax_out": "pointer(amax_out)",
                 out: f"{out}.data_ptr() if stores else 0", f"{out}_t": f"{out}_t.data_ptr() if stores and transpose else 0"}
        values = [asked.get(p.name, v) for p, v in zip(abi, values)]
    if spec.ctx.get("column_tiled"):  # a column-tiled launch (no partials), then row splits' (no grads)
        assert arguments == [["0" if p.name == unwritten else v for p, v in zip(abi, values)]
                             for unwritten in ("partials", "column_grads")]
    else:
        assert arguments and all(args == values for args in arguments)


def test_every_family_is_covered():
    assert {s.family for s in SPECS} == {"norm_fwd", "norm_bwd", "column_sum", "elementwise_fwd", "elementwise_bwd",
                                         "attention_prep", "quantize"}
