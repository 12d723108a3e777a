"""Emit: plans → the files of the output package (Python modules and CUDA sources).

The straight-line forward and backward of each pipeline are written here as lines of Python, one
block per stage, headed by a comment naming the rule that made the stage; jinja templates lay the
files out. Every name is derived from the spec (``linear1_weight``, ``d_layernorm0_out``), so a
change to a spec or a rule shows up as a readable diff.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
from fractions import Fraction
from pathlib import Path

import jinja2

from .diagram import flowchart
from .ir import Sym, size_expr
from .plan import Plan
from .stages import Block, Emitter
from .stages.elementwise import random_ops
from .stages.module import lead_name, module_name
from .stages.base import extra_input_name, extra_output_name, param_name, stage_label, value_name


def _templates_dir() -> Path:
    """templates/ as installed: the folder fusegen.templates maps to (beside generator/ in a
    checkout installed in editable mode, fusegen/templates in a wheel)."""
    spec = importlib.util.find_spec(f"{__package__}.templates")
    return Path(next(iter(spec.submodule_search_locations)))


TEMPLATES = _templates_dir()


@functools.cache
def environment() -> jinja2.Environment:
    """The templates' environment, one a process: it keeps each template compiled (jinja2 reloads
    one whose file changed), so a second build in the same process (a library user's, a test's)
    does not parse and compile every template again (two thirds of the builds' time in a profiled
    test run)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True, trim_blocks=False, lstrip_blocks=False,
    )
    # A size (ir.Size: an int, or a Sym of a size-generic pipeline) as an expression in the
    # kernel's N (CUDA) or the launcher's n (Python).
    env.filters["cexpr"] = lambda size: size_expr(size, "N", "/")
    env.filters["pyexpr"] = lambda size: size_expr(size, "n", "//")
    return env


# --- forward and backward: each stage's implementation writes its own lines ----------------------

def forward_blocks(em: Emitter, stages=None, label: str = "forward") -> list[Block]:
    """Blocks of the forward (``stages``: the plan's forward, or its no-grad forward)."""
    blocks = []
    for n, stage in enumerate(em.plan.forward if stages is None else stages):
        block = Block(f"{label} stage {n} · rule {stage.rule.name} · {stage_label(stage)}"
                      + (" · no kernel" if stage.kind == "passthrough" else ""))
        em.values[stage.end] = stage.rule.stage.forward(em, stage, block)
        blocks.append(block)
    return blocks


def backward_blocks(em: Emitter) -> tuple[list[Block], str]:
    """Blocks of the backward (last stage first) and the name of the pipeline input's grad."""
    p = em.pipeline
    grads: dict[int, str] = {len(p.ops): "d_" + em.values[len(p.ops)]}
    blocks = []
    for n, stage in reversed(list(enumerate(em.plan.backward))):
        block = Block(f"backward stage {n} · rule {stage.rule.name} · {stage_label(stage)}"
                      + (" · no kernel" if stage.kind == "passthrough" else ""))
        d_in = "d_" + em.values.get(stage.start, value_name(p, stage.start))
        grads[stage.start] = stage.rule.stage.backward(em, stage, block, grads[stage.end], d_in)
        blocks.append(block)
    return blocks, grads[0]


def no_grad_blocks(plan: Plan, stage_kernels: dict) -> list[Block]:
    """Blocks of the no-grad forward: its stages, writing nothing for a backward."""
    kernels = {("forward", start): specs for (pass_, start), specs in stage_kernels.items() if pass_ == "inference"}
    return forward_blocks(Emitter(plan, kernels, saving=False), plan.inference, "no-grad")


def runs_as(plan: Plan, stage_kernels: dict) -> dict[tuple[str, int], str]:
    """The plan's "runs as" cell per stage, keyed by (pass, stage start)."""
    return {(pass_, stage.start): stage.rule.stage.runs_as("backward" if pass_ == "backward" else "forward", stage,
                                                           stage_kernels.get((pass_, stage.start), []))
            for pass_, stages in (("forward", plan.forward), ("backward", plan.backward), ("inference", plan.inference))
            for stage in stages}


def placement(op) -> tuple[str, str]:
    """The device= and dtype= expressions for ``op``'s parameters: the module's own arguments, or
    where the spec placed the op (TE's device=/dtype=) when the module is given none."""
    device, dtype = op.args.get("device"), op.args.get("dtype")
    return ("device" if device is None else f"device if device is not None else {device!r}",
            "dtype" if dtype is None else f"dtype if dtype is not None else {dtype!r}")


# --- whole files --------------------------------------------------------------------------------

def leading_dims(p) -> tuple[dict[int, str], list[str]]:
    """The name of the leading dims in effect at each op's input in the generated module (its
    extra inputs and outputs have them), and the lines that compute them: ``x.shape[:-1]``, then
    a new ``leadK`` after each Reshape (and each view around a multi-dim norm, named by the
    spec's call)."""
    calls = {node.module_index: node.module_call for node in p.graph.nodes}
    current, names, lines = "lead", {}, []
    for op in p.ops:
        names[op.index] = current
        new = f"lead{len(lines) + 1}"
        if op.opdef.reshape is not None:
            shape, numel = op.opdef.reshape(op.args), f"{current}.numel() * {size_expr(op.in_features, 'n', '//')}"
            # a -1 last dim: the size the ops after it fix, or a run-time width of its own
            out, inferred = op.out_features, shape[-1] == -1
            width = out.width if isinstance(out, Sym) and not out.of_input else ""
            checks = (f", last={out}" if inferred and not width else
                      f", multiple_of={p.divisor_of(width)}" if width and p.divisor_of(width) > 1 else "")
            lines.append(f'{new} = ref.reshaped_lead("{p.class_name}", "{op.describe()} ({op.location})", '
                         f"{shape!r}, {numel}{checks})")
            if width:
                lines.append(f"{width} = {numel} // {new}.numel()")
            current = new
        elif op.opdef.new_lead is not None:
            helper, dims = op.opdef.new_lead(op.args)
            where = f'"{p.class_name}", "{calls[op.module_index]} ({op.location})", ' if helper == "flattened_lead" else ""
            lines.append(f"{new} = ref.{helper}({where}{current}, {dims!r})")
            current = new
    names[len(p.ops)] = current
    return names, lines


def user_modules(pipeline) -> list:
    """The ops that run a module of the user's code (ops/module.py)."""
    return [op for op in pipeline.ops if op.opdef.user_module]


def row_inputs(pipeline) -> list:
    """The ops whose extra input holds one value per row (a row-scaled activation's scales)."""
    return [op for op in pipeline.ops if op.opdef.operand is not None and op.opdef.operand.broadcast == "row"]


def distinct_returns(names: list[str], aliases: dict[str, str]) -> list[str]:
    """The Function's outputs, a tensor returned twice (an extra output that is the output itself)
    the second time as a view of it: torch.compile cannot trace one tensor as two outputs."""
    seen: set[str] = set()
    out = []
    for name in names:
        tensor = aliases.get(name, name)
        out.append(f"{name}.view_as({name})" if tensor in seen else name)
        seen.add(tensor)
    return out


def _sizes_literal(sizes) -> str:
    """A tuple literal of feature sizes: ints, "rows" (one value per row), (size-generic) their
    expressions in n, 'n // 2', or None after a Reshape whose last dim is known only at run time."""
    return repr(tuple(size if isinstance(size, (int, str)) else size_expr(size, "n", "//") if size.of_input else None
                      for size in sizes))


def children(pipeline, params: dict, modules_run: list) -> list:
    """The module's children, one per op of the spec's Sequential in order: (index, the op's call
    as the spec writes it, its parameters, the Op when it is a module of the user's code)."""
    calls: dict[int, str] = {}
    for node in pipeline.graph.nodes:
        calls.setdefault(node.module_index, node.module_call)
    users = {op.module_index: op for op in modules_run}
    return [(index, call, params.get(index, []), users.get(index)) for index, call in sorted(calls.items())]


def saved_table(plan: Plan, em: Emitter, saved: list[str], params: list) -> list[tuple[str, str, str]]:
    """(name, shape, dtype) of each tensor the backward reads, for the plan: values and extra
    inputs are [rows, features] in x's dtype; the stages say what their own results are."""
    p = plan.pipeline
    shapes: dict[str, tuple[str, str]] = {}
    for pos in plan.saved_values:
        features = p.ops[pos].in_features if pos < len(p.ops) else p.out_features
        shapes[em.values[pos]] = (f"[rows, {features}]", "x's dtype")
    for op in p.ops:
        if op.extra_input is not None:
            shapes[extra_input_name(op)] = (f"[rows, {op.in_features}]", "x's dtype")
    for stage in plan.backward:
        shapes.update(stage.rule.stage.saved_shapes(em, stage))
    for *_, shape, init, name in params:
        shapes[name] = (str(list(shape)), "the parameter's dtype (its values, not a copy)")
    return [(name, *shapes.get(name, ("", ""))) for name in saved]


def traffic_cells(plan: Plan) -> dict[tuple[str, int], str]:
    """The plan's "bytes/token" cell per stage, keyed like ``runs_as``: what the stage's kernel
    calls and GEMMs read and write per token of the module's input (StageImpl.row_traffic) at 2
    bytes a value (bf16, fp16; fp32 activations double it), fp32 statistics 4; "—" where the plan
    cannot know. A Reshape before a stage changes its rows per token (``rows_factor``)."""
    factors, factor = {}, Fraction(1)  # rows per token at each value position (None: unknown)
    for stage in plan.forward:
        factors.update(dict.fromkeys(range(stage.start, stage.end), factor))
        change = stage.rule.stage.rows_factor(stage)
        factor = None if factor is None or change is None else factor * change
    cells = {}
    for pass_, stages in (("forward", plan.forward), ("backward", plan.backward), ("inference", plan.inference)):
        for stage in stages:
            traffic = stage.rule.stage.row_traffic(plan, pass_, stage)
            if traffic is None or factors[stage.start] is None:
                cells[(pass_, stage.start)] = "—"
                continue
            per_token = traffic.bytes() * factors[stage.start]
            cells[(pass_, stage.start)] = f"{int(per_token):,}" if per_token.denominator == 1 else f"{float(per_token):,.1f}"
    return cells


def replays_graphs(plan: Plan) -> bool:
    """Whether the module replays its forward and backward from CUDA graphs at a few rows (the
    runtime's CudaGraphs): worth it from two launches on, where a graph can capture every stage."""
    launching = [s for s in plan.inference if s.rule.stage.launches and s.kind != "passthrough"]
    every = [*plan.inference, *plan.forward, *plan.backward]
    return len(launching) >= 2 and all(s.rule.stage.replayable for s in every)


def no_grad_op(name: str, inputs: list[str], blocks: list[Block], outputs: list[str]) -> tuple[str, str]:
    """torch.compile's custom op for a graph-replaying pipeline's no-grad forward (in the "fusegen"
    namespace): its name, the pipeline's and a digest of the function's arguments, lines and
    returns (packages that hold the same pass share its op, and a changed pass gets a new one),
    and its schema."""
    schema = ", ".join(("bool " if arg == "training" else "Tensor ") + arg for arg in inputs)
    returns = "Tensor" if len(outputs) == 1 else "(" + ", ".join(["Tensor"] * len(outputs)) + ")"
    text = "\n".join([schema, *(line for block in blocks for line in block.lines), *outputs])
    return f"{name}_no_grad_{hashlib.sha256(text.encode()).hexdigest()[:8]}", f"({schema}) -> {returns}"


def pipeline_context(plan: Plan, stage_kernels: dict) -> dict:
    p = plan.pipeline
    graphs = replays_graphs(plan)
    # with graphs, the stages are functions of their own (forward_stages, backward_stages)
    em = Emitter(plan, stage_kernels, width="n" if graphs else "ctx.n")
    fwd = forward_blocks(em)
    bwd, d_x = backward_blocks(em)
    values = em.values
    extra_inputs = [extra_input_name(op) for op in p.ops if op.extra_input is not None]
    # in number order: the public ones, then the hidden ones of ops that write back (Op.writes_back_to)
    tees = sorted((op for op in p.ops if op.extra_output is not None), key=lambda op: op.extra_output)
    extra_outputs = [extra_output_name(op) for op in tees]
    params = [(op, attr, key, shape, init, param_name(op, attr)) for op, attr, key, shape, init in p.params]
    saved = [values[pos] for pos in plan.saved_values]
    saved += [name for stage in plan.backward for name in stage.rule.stage.saved_names(em, stage)]
    saved += [extra_input_name(op) for op in p.ops if op.extra_input in plan.saved_extra_inputs]
    backward_code = "\n".join(line for block in bwd for line in block.lines + [e for _, e in block.weight_grads])
    saved += [name for *_, name in params if re.search(rf"\b{name}\b", backward_code)]
    modules = {}
    for op, attr, key, shape, init, name in params:
        modules.setdefault(op.module_index, []).append((attr, shape, init, name, *placement(op)))
    leads, lead_lines = leading_dims(p)
    modules_run, per_row = user_modules(p), row_inputs(p)
    takes_training = bool(random_ops(p.ops))  # the forward depends on the training mode (Dropout)
    cells = runs_as(plan, stage_kernels)
    grad_outputs = ["d_" + values[len(p.ops)]] + ["d_" + e for e in extra_outputs]
    grad_inputs = ([d_x] + ["d_" + e for e in extra_inputs] + ["d_" + name for *_, name in params]
                   + (["None"] if takes_training else [])  # training is a flag, not a tensor
                   + ["None", "None"] * len(modules_run))  # a user module and its leading dims
    weight_grads = {name for block in bwd for name, _ in block.weight_grads}
    saved = list(dict.fromkeys(saved))
    # the Function's forward and the no-grad forward take the same arguments
    function_inputs = (["x", *extra_inputs, *(name for *_, name in params)] + (["training"] if takes_training else [])
                       + [name for op in modules_run for name in (module_name(op), lead_name(op))])
    no_grad = no_grad_blocks(plan, stage_kernels)
    return dict(
        traffic=traffic_cells(plan),
        pipeline=p, plan=plan, forward=fwd, backward=bwd, output=values[len(p.ops)],
        function_returns=distinct_returns([values[len(p.ops)]] + extra_outputs, em.aliases),
        no_grad=no_grad, no_grad_fuses_more=plan.inference != plan.forward,
        extra_inputs=extra_inputs, extra_outputs=extra_outputs, params=params,
        public_extra_outputs=[op for op in tees if op.writes_back_to is None],
        # the extra inputs written back, and those the backward reads (the forward gets a copy of
        # them: the caller's tensor changes after it)
        written_back=[(op, extra_inputs[op.writes_back_to]) for op in p.written_back],
        copied_extra_inputs={op.writes_back_to for op in p.written_back if op.writes_back_to in plan.saved_extra_inputs},
        param_names=[name for *_, name in params],
        extra_input_features=_sizes_literal("rows" if op in per_row else op.in_features
                                            for op in p.ops if op.extra_input is not None),
        row_inputs=per_row,
        extra_output_features=_sizes_literal(p.graph.features(v) for v in p.graph.outputs[1:]),
        saved=saved, children=children(p, modules, modules_run),
        saved_table=saved_table(plan, em, saved, params),
        grad_outputs=grad_outputs, grad_inputs=grad_inputs,
        # with graphs: what backward_stages returns (the grads but the weight grads, then what the
        # weight-grad GEMMs after it read) and takes (the input width last, in a size-generic
        # pipeline that reshapes)
        stage_grads=[g for g in grad_inputs if g != "None" and g not in weight_grads],
        weight_grad_operands=list(dict.fromkeys(r for block in bwd for r in block.weight_grad_reads
                                                if r not in grad_outputs)),
        backward_stages_inputs=grad_outputs + saved + (["n"] if p.generic and lead_lines else []),
        user_modules=[(op, module_name(op), lead_name(op)) for op in modules_run],
        takes_training=takes_training, cuda_graphs=graphs, function_inputs=function_inputs,
        no_grad_op=no_grad_op(p.name, function_inputs, no_grad, [values[len(p.ops)]] + extra_outputs) if graphs else None,
        leads=leads, lead_lines=lead_lines,
        kernels=stage_kernels, runs_as=cells, diagrams=diagrams(plan, cells, extra_inputs, extra_outputs),
    )


def diagrams(plan: Plan, cells: dict, extra_inputs: list[str], extra_outputs: list[str]) -> dict[str, str]:
    """The plan's Mermaid flowcharts: forward in the order it runs, backward likewise (last stage first)."""
    return {"forward": flowchart("f", list(enumerate(plan.forward)), cells, "forward", extra_inputs, extra_outputs),
            "backward": flowchart("b", list(reversed(list(enumerate(plan.backward)))), cells, "backward",
                                  extra_inputs, extra_outputs)}
