"""Emit: plans → the files of the output package (Python modules and CUDA sources).

The straight-line forward and backward of each pipeline are written here as lines of Python, one
block per stage, headed by a comment naming the rule that made the stage; jinja templates lay the
files out. Every name is derived from the spec (``linear1_weight``, ``d_layernorm0_out``), so a
change to a spec or a rule shows up as a readable diff.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from . import kernels as kn
from .pipeline import Op, Pipeline
from .plan import Plan, Stage

def _templates_dir() -> Path:
    """templates/ as installed: the folder fusegen.templates maps to (beside generator/ in a
    checkout installed in editable mode, fusegen/templates in a wheel)."""
    spec = importlib.util.find_spec(f"{__package__}.templates")
    return Path(next(iter(spec.submodule_search_locations)))


TEMPLATES = _templates_dir()


def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True, trim_blocks=False, lstrip_blocks=False,
    )


# --- names --------------------------------------------------------------------------------------

def value_name(pipeline: Pipeline, position: int) -> str:
    """Name of forward value ``position`` (the input of op ``position``)."""
    if position == 0:
        return "x"
    op = pipeline.ops[position - 1]
    if position < len(pipeline.ops) and pipeline.ops[position].module_index == op.module_index:
        return f"{op.hint}_pre_{pipeline.ops[position].kind}"  # inside a container: Linear's matmul output
    return f"{op.hint}_out"


def param_name(op: Op, attr: str) -> str:
    return f"{op.hint}_{attr}"


def extra_input_name(op: Op) -> str:
    """Public: named by order among the pipeline's extra inputs, so inserting an op elsewhere in
    the spec never renames a caller's keyword argument."""
    return f"extra_input{op.extra_input}"


def extra_output_name(op: Op) -> str:
    return f"extra_output{op.extra_output}"


def op_of(pipeline: Pipeline, stage: Stage, name: str, prefix: str) -> Op:
    """The op a launcher operand names, e.g. 'bias2' (prefix 'bias') is the stage's op 2."""
    return pipeline.ops[stage.start + int(name[len(prefix):])]


def stage_label(stage: Stage) -> str:
    return ", ".join(op.describe() for op in stage.ops)


@dataclass
class Block:
    """One stage's lines in the generated forward or backward."""

    title: str
    lines: list[str] = field(default_factory=list)


# --- forward ------------------------------------------------------------------------------------

def forward_blocks(plan: Plan, stage_kernels: dict) -> tuple[list[Block], dict[int, str], dict[int, str]]:
    """Blocks of the forward, the name of each materialised value, and the norm statistics names."""
    p = plan.pipeline
    values: dict[int, str] = {0: "x"}
    stats: dict[int, list[str]] = {}  # norm op index -> names of its saved statistics
    blocks = []
    for n, stage in enumerate(plan.forward):
        block = Block(f"forward stage {n} · rule {stage.rule.name} · {stage_label(stage)}"
                      + (" · no kernel" if stage.kind == "passthrough" else ""))
        x_in, out = values[stage.start], value_name(p, stage.end)
        if stage.kind == "gemm":
            linear, bias = stage.first("linear"), stage.first("bias")
            w = param_name(linear, "weight")
            if bias is not None:
                block.lines.append(f"{out} = torch.addmm({param_name(bias, 'bias')}, {x_in}, {w}.t())")
            else:
                block.lines.append(f"{out} = {x_in}.mm({w}.t())")
        elif stage.kind == "norm":
            spec = stage_kernels[("forward", stage.start)][0]
            norm, add, meo = stage.first("norm"), stage.first("add_extra_input"), stage.first("make_extra_output")
            args = [x_in] + ([extra_input_name(add)] if add else []) + [param_name(norm, "weight")]
            args += [param_name(norm, "bias")] if norm.opdef.name == "LayerNorm" else []
            results = [out]
            if add:
                summed = extra_output_name(meo) if meo else value_name(p, norm.index)
                values[norm.index] = summed
                results.append(summed)
            if norm.opdef.name == "LayerNorm":
                results.append(f"{norm.hint}_mean")
            results.append(f"{norm.hint}_rstd")
            stats[norm.index] = results[1 + bool(add):]
            block.lines.append(f"{', '.join(results)} = kernels.{spec.name}({', '.join(args)})")
        elif stage.kind == "elementwise":
            spec = stage_kernels[("forward", stage.start)][0]
            io = kn.launcher_io(spec)
            at = lambda name, prefix: op_of(p, stage, name, prefix)  # noqa: E731
            operands = [param_name(at(o, "bias"), "bias") if o.startswith("bias")
                        else extra_input_name(at(o, "extra_in")) for o in io["operands"]]
            results = [out] + [extra_output_name(at(w, "extra_out")) for w in io["written"]]
            block.lines.append(f"{', '.join(results)} = kernels.{spec.name}({', '.join([x_in] + operands)})")
            for index, alias in kn.forward_aliases(stage).items():
                if alias != "write":
                    block.lines.append(f"{extra_output_name(p.ops[index])} = {x_in if alias == 'input' else out}")
        else:  # passthrough: MakeExtraOutput hands out its input as is
            out = x_in
            for op in stage.ops:
                if op.kind == "make_extra_output":
                    block.lines.append(f"{extra_output_name(op)} = {x_in}")
        values[stage.end] = out
        blocks.append(block)
    return blocks, values, stats


# --- backward -----------------------------------------------------------------------------------

def backward_blocks(plan: Plan, stage_kernels: dict, values: dict[int, str],
                    stats: dict[int, list[str]]) -> tuple[list[Block], str]:
    """Blocks of the backward (last stage first) and the name of the pipeline input's grad."""
    p = plan.pipeline
    grads: dict[int, str] = {len(p.ops): "d_" + values[len(p.ops)]}
    blocks = []
    for n, stage in reversed(list(enumerate(plan.backward))):
        block = Block(f"backward stage {n} · rule {stage.rule.name} · {stage_label(stage)}"
                      + (" · no kernel" if stage.kind == "passthrough" else ""))
        dy = grads[stage.end]
        d_in = "d_" + values.get(stage.start, value_name(p, stage.start))
        if stage.kind == "gemm":
            linear, meo = stage.first("linear"), stage.first("make_extra_output")
            w = param_name(linear, "weight")
            if meo is not None:
                block.lines.append(f"{d_in} = torch.addmm(d_{extra_output_name(meo)}, {dy}, {w})")
            else:
                block.lines.append(f"{d_in} = {dy}.mm({w})")
            block.lines.append(f"d_{w} = {dy}.t().mm({values[linear.index]})")
        elif stage.kind == "norm":
            spec = stage_kernels[("backward", stage.start)][0]
            norm, add, meo = stage.first("norm"), stage.first("add_extra_input"), stage.first("make_extra_output")
            args = [dy, values[norm.index], *stats[norm.index], param_name(norm, "weight")]
            args += [f"d_{extra_output_name(meo)}"] if meo else []
            results = [d_in, f"d_{param_name(norm, 'weight')}"]
            results += [f"d_{param_name(norm, 'bias')}"] if norm.opdef.name == "LayerNorm" else []
            block.lines.append(f"{', '.join(results)} = kernels.{spec.name}({', '.join(args)})")
            if add:
                block.lines.append(f"d_{extra_input_name(add)} = {d_in}  # the residual's grad is the sum's grad")
        elif stage.kind == "elementwise":
            spec = stage_kernels[("backward", stage.start)][0]
            io = kn.launcher_io(spec)
            at = lambda name, prefix: op_of(p, stage, name, prefix)  # noqa: E731
            operands = []
            for o in io["operands"]:
                if o == "x":
                    operands.append(values[plan.recompute[stage.start].saved_position])
                elif o.startswith("bias"):
                    operands.append(param_name(at(o, "bias"), "bias"))
                elif o.startswith("extra_in"):
                    operands.append(extra_input_name(at(o, "extra_in")))
                else:
                    operands.append("d_" + extra_output_name(at(o, "d_extra_out")))
            biases = [op for op in stage.ops if op.kind == "bias"]
            if not spec.ctx["writes_dx"]:
                d_in = dy
            names = {"dx": d_in}
            names.update({f"d_extra_in{op.index - stage.start}": "d_" + extra_input_name(op)
                          for op in stage.ops if op.kind == "add_extra_input"})
            names.update({f"dbias{op.index - stage.start}": "d_" + param_name(op, "bias") for op in biases})
            block.lines.append(f"{', '.join(names[r] for r in io['returned'])} = kernels.{spec.name}({', '.join([dy] + operands)})")
            for index, alias in kn.backward_aliases(stage).items():
                if alias != "write":
                    block.lines.append(f"d_{extra_input_name(p.ops[index])} = {dy if alias == 'dy' else d_in}")
        else:  # passthrough: AddExtraInput hands its grad to both inputs
            d_in = dy
            for op in stage.ops:
                if op.kind == "add_extra_input":
                    block.lines.append(f"d_{extra_input_name(op)} = {dy}")
        grads[stage.start] = d_in
        blocks.append(block)
    return blocks, grads[0]


# --- whole files --------------------------------------------------------------------------------

def pipeline_context(plan: Plan, stage_kernels: dict) -> dict:
    p = plan.pipeline
    fwd, values, stats = forward_blocks(plan, stage_kernels)
    bwd, d_x = backward_blocks(plan, stage_kernels, values, stats)
    extra_inputs = [extra_input_name(op) for op in p.ops if op.extra_input is not None]
    extra_outputs = [extra_output_name(op) for op in p.ops if op.extra_output is not None]
    params = [(op, attr, key, shape, init, param_name(op, attr)) for op, attr, key, shape, init in p.params]
    saved = [values[pos] for pos in plan.saved_values]
    saved += [name for stage in plan.backward if stage.kind == "norm" for name in stats[stage.first("norm").index]]
    saved += [extra_input_name(op) for op in p.ops if op.extra_input in plan.saved_extra_inputs]
    backward_code = "\n".join(line for block in bwd for line in block.lines)
    saved += [name for *_, name in params if re.search(rf"\b{name}\b", backward_code)]
    modules = {}
    for op, attr, key, shape, init, name in params:
        modules.setdefault(op.module_index, []).append((attr, shape, init, name))
    return dict(
        pipeline=p, plan=plan, forward=fwd, backward=bwd, output=values[len(p.ops)],
        extra_inputs=extra_inputs, extra_outputs=extra_outputs, params=params,
        param_names=[name for *_, name in params],
        extra_input_features=repr(tuple(op.in_features for op in p.ops if op.extra_input is not None)),
        extra_output_features=repr(tuple(op.in_features for op in p.ops if op.extra_output is not None)),
        saved=list(dict.fromkeys(saved)), modules=sorted(modules.items()),
        grad_outputs=["d_" + values[len(p.ops)]] + ["d_" + e for e in extra_outputs],
        grad_inputs=[d_x] + ["d_" + e for e in extra_inputs] + ["d_" + name for *_, name in params],
        kernels=stage_kernels,
    )
