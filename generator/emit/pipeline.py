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
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

import jinja2

from .. import source_text
from ..diagram import flowchart
from ..errors import Location
from ..ir import Size, Sym, size_expr
from ..pipeline import Op
from ..plan import Plan
from ..source_text import py_string
from ..stages import Block, Emitter
from ..stages.module import lead_name, module_name
from ..stages.base import extra_input_name, extra_output_name, param_name, stage_label
from . import convention
from ..calls import Alias, TorchCall, literal
from ..values import Role


def _templates_dir() -> Path:
    """templates/ as installed: the folder fusegen.templates maps to (beside generator/ in a
    checkout installed in editable mode, fusegen/templates in a wheel)."""
    spec = importlib.util.find_spec(f"{__package__.rpartition('.')[0]}.templates")
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
    # a spec's own text (a user module's call, a file name) where it lands (source_text.py)
    env.filters["pystr"] = source_text.py_string
    env.filters["comment"] = source_text.comment_text
    env.filters["docstring"] = source_text.docstring_text
    env.filters["mdcode"] = source_text.md_code
    return env


# --- forward and backward: each stage's implementation writes its own lines ----------------------

def forward_blocks(em: Emitter, stages=None, label: str = "forward") -> list[Block]:
    """Blocks of the forward (``stages``: the plan's forward, or its no-grad forward)."""
    blocks = []
    for n, stage in enumerate(em.plan.forward if stages is None else stages):
        block = Block(f"{label} stage {n} · rule {stage.rule.name} · {stage_label(stage)}"
                      + (" · no kernel" if stage.kind == "passthrough" else ""), name=em.name)
        em.names[stage.output] = stage.rule.stage.forward(em, stage, block)
        blocks.append(block)
    return blocks


def backward_blocks(em: Emitter) -> tuple[list[Block], dict[int, str]]:
    """Blocks of the backward (last stage first) and the name of the grad of each value a stage
    reads (0: the pipeline input's)."""
    p = em.pipeline
    grads: dict[int, str] = {p.output: "d_" + em.name(p.output)}
    blocks = []
    for n, stage in reversed(list(enumerate(em.plan.backward))):
        block = Block(f"backward stage {n} · rule {stage.rule.name} · {stage_label(stage)}"
                      + (" · no kernel" if stage.kind == "passthrough" else ""), name=em.name)
        d_in = "d_" + em.name(stage.input)
        grads[stage.input] = stage.rule.stage.backward(em, stage, block, grads[stage.output], d_in)
        blocks.append(block)
    return blocks, grads


def own_memory(em: Emitter, returned: list[str]) -> Block | None:
    """Gives each returned grad that shares memory with one returned before it (an addend's grad
    is the sum's: one tensor for two inputs, or a view of it) a copy: its alias line becomes a
    clone, or a last backward block (returned, else None) copies it. Autograd may keep a returned
    grad as a leaf's ``.grad`` and accumulate the next one into it in place: two leaves with one
    memory would each get the other's grads too."""
    block = Block("each returned grad its own memory (a leaf's .grad accumulates in place)")
    owners: dict[str, str] = {}
    for name in dict.fromkeys(returned):
        memory = em.memory_of(name)
        if memory not in owners:
            owners[memory] = name
        elif name in em.grad_aliases:
            alias_block, index, of, why = em.grad_aliases[name]
            reason = f"{why}, in memory of its own" if why else "in memory of its own (.grad accumulates in place)"
            alias_block.calls[index] = Alias(name, of, reason, clone=True)
        else:
            block.add(Alias(name, name, f"a copy, not {owners[memory]}'s memory", clone=True))
    return block if block.calls else None


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
            where = py_string(f"{op.describe()} (op {op.number} at {op.location})")
            lines.append(f'{new} = ref.reshaped_lead("{p.class_name}", {where}, {shape!r}, {numel}{checks})')
            if width:
                lines.append(f"{width} = {numel} // {new}.numel()")
            current = new
        elif op.opdef.new_lead is not None:
            helper, dims = op.opdef.new_lead(op.args)
            call = py_string(f"{calls[op.module_index]} (op {op.module_index} at {op.location})")
            where = f'"{p.class_name}", {call}, ' if helper == "flattened_lead" else ""
            lines.append(f"{new} = ref.{helper}({where}{current}, {dims!r})")
            current = new
    names[len(p.ops)] = current
    return names, lines


class SpecRow(NamedTuple):
    """One op of the spec as the plan's Ops table and the module's docstring list it."""

    number: str  # pipeline.spec_numbers
    call: str  # the basic op as a spec would write it
    note: str  # what the plan adds: a view's, or a write-back's
    in_features: Size
    out_features: Size
    location: Location
    op: Op | None  # None for a view


def spec_rows(pipeline, extra_inputs: list[str]) -> list[SpecRow]:
    """The spec's ops in order: each basic op of the planner's chain and each view (Identity),
    which the chain leaves out but the spec's numbering counts."""
    rows = []
    for op in pipeline.ops:
        note = ""
        if op.writes_back_to is not None:  # the hidden tee after an in-place add, numbered after it
            added = pipeline.ops[op.index - 1]
            note = (f"the sum of op {added.number}, written into the caller's "
                    f"{extra_inputs[op.writes_back_to]} (`in_place=True`)")
        rows.append((op.module_index, SpecRow(op.number, op.describe(), note, op.in_features, op.out_features,
                                              op.location, op)))
    graph = pipeline.graph
    rows += [(node.module_index, SpecRow(str(node.module_index), node.opdef.describe(node.args), "a view, nothing runs",
                                         graph.features(node.inputs[0]), graph.features(node.outputs[0]),
                                         node.location, None))
             for node in graph.nodes if node.opdef.view]
    return [row for _, row in sorted(rows, key=lambda pair: pair[0])]  # stable: a spec op's parts stay in order


def takes_any_shape(pipeline) -> bool:
    """Whether x may have any shape, 0-D included, as TE's elementwise ops take: a size-generic
    pipeline in which every value is as wide as x (no GLU halves it). Its results before any
    Reshape have x's shape."""
    return pipeline.generic and all(value.features == pipeline.in_features for value in pipeline.values
                                    if value.role is Role.ACTIVATION)


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


def _tuple_literal(items) -> str:
    """A tuple literal of the given expressions: (a, b), (a,)."""
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


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
    for value in plan.saved_values:
        shapes[em.name(value)] = (f"[rows, {p.features(value)}]", "x's dtype")
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


def no_grad_op(name: str, args: list[convention.Argument], blocks: list[Block], outputs: list[str]) -> tuple[str, str]:
    """torch.compile's custom op for a graph-replaying pipeline's no-grad forward (in the "fusegen"
    namespace): its name, the pipeline's and a digest of the function's arguments, lines and
    returns (packages that hold the same pass share its op, and a changed pass gets a new one),
    and its schema."""
    text = "\n".join([convention.schema_arguments(args), *(line for block in blocks for line in block.lines), *outputs])
    return (f"{name}_no_grad_{hashlib.sha256(text.encode()).hexdigest()[:8]}",
            convention.schema(args, len(outputs)))


def _reads(blocks: list[Block]) -> list[int]:
    """The values ``blocks``' calls read, in order, each once."""
    return list(dict.fromkeys(value for block in blocks for value in block.reads()))


def saved_for_backward(plan: Plan, em: Emitter, bwd: list[Block]) -> list[int]:
    """What the forward keeps for the backward: the forward values the backward's calls read, in
    ctx.save_for_backward's order: running values in chain order, the stages' own results (a
    norm's statistics, a random op's key) as the backward stages read them in forward order,
    extra inputs, parameters (their values, not copies)."""
    p = plan.pipeline
    reads = _reads(list(reversed(bwd)))  # backward_blocks runs the last stage first
    running = {0, *(op.output for op in p.ops)}
    free = set(p.extra_input_values) | {value for op in p.ops for _, value in op.param_ids}
    values = sorted((v for v in reads if v in running), key=p.chain_order)
    extra = [v for v in p.extra_input_values if v in reads]
    # the planner decided what the forward materialises for these (Saves): the calls must agree
    assert set(values) == set(plan.saved_values) and set(extra) == set(plan.saved_extra_inputs), \
        f"{p.name}: the backward reads {values} + {extra}, the plan saves {plan.saved_values} + {plan.saved_extra_inputs}"
    own = [v for v in reads if v not in running and v not in free and v != p.input_width]
    params = [value for op in p.ops for _, value in op.param_ids if value in reads]
    return values + own + extra + params


def segments(plan: Plan, em: Emitter, fwd: list[Block], bwd: list[Block], grads: dict[int, str], saved: list[int],
             tees: list, inputs: list[int]) -> tuple[list[dict], list[Block]]:
    """A pipeline that runs user modules, under autograd: its fused stages between them as autograd
    Functions of their own (one a run of stages), the modules between them in ``grad_forward``,
    so autograd records each module as eager PyTorch does (stages/module.py). Returns each
    Function's parts (``inputs``: its arguments, of the names the pipeline's forward has, with
    ``n`` for the input width a size-generic backward reshapes with) and grad_forward's steps."""
    p = plan.pipeline
    backward_of = list(zip(reversed(plan.backward), bwd))  # backward_blocks runs the last stage first
    steps = []
    for stage, block in zip(plan.forward, fwd):
        if stage.rule.stage.between_functions:
            steps.append(block)
        elif steps and isinstance(steps[-1], list):
            steps[-1].append((stage, block))
        else:
            steps.append([(stage, block)])
    functions = []
    for k, run in enumerate(step for step in steps if isinstance(step, list)):
        start, end = run[0][0].start, run[-1][0].end  # the run's ops
        blocks = [block for _, block in run]
        backward = [block for stage, block in backward_of if start <= stage.start < end]
        first, last = run[0][0], run[-1][0]
        outputs = [em.name(last.output)] + [extra_output_name(op) for op in tees if start <= op.index < end]
        forward_reads = _reads(blocks)
        taken = [value for value in inputs[1:] if value in forward_reads]  # the free values the run reads
        args = [em.name(first.input)] + [em.name(value) for value in taken]
        grad_inputs = [grads[first.input]] + [("d_" + em.name(v)) if em.table[v].role in convention.TENSOR_ROLES
                                              else "None" for v in taken]
        copies = own_memory(em, [g for g in grad_inputs if g != "None"])
        backward += [copies] if copies else []
        backward_reads = _reads(backward)
        takes_n = p.input_width is not None and p.input_width in backward_reads
        functions.append(dict(
            name=f"{p.class_name}Function{k}", first=first.ops[0].number, last=last.ops[-1].number,
            forward=blocks, backward=backward,
            inputs=args + (["n"] if takes_n else []), takes_n=takes_n, outputs=outputs,
            returns=distinct_returns(outputs, em.aliases), saved=[em.name(v) for v in saved if v in backward_reads],
            grad_outputs=["d_" + name for name in outputs],
            grad_inputs=grad_inputs + (["None"] if takes_n else []),
        ))
    calls = iter(functions)
    return functions, [step if isinstance(step, Block) else _call_block(next(calls)) for step in steps]


def _call_block(function: dict) -> Block:
    """grad_forward's step that applies one of the Functions of ``segments``."""
    outputs = function["outputs"]
    args = ["x.shape[1]" if name == "n" else name for name in function["inputs"]]
    block = Block(f"ops {function['first']} to {function['last']}, fused")
    block.add(TorchCall(literal(f"{', '.join(outputs)} = {function['name']}.apply({', '.join(args)})")))
    return block


def pipeline_context(plan: Plan, stage_kernels: dict) -> dict:
    p = plan.pipeline
    graphs = replays_graphs(plan)
    # with graphs, the stages are functions of their own (forward_stages, backward_stages)
    em = Emitter(plan, stage_kernels, width="n" if graphs else "ctx.n")
    fwd = forward_blocks(em)
    bwd, grads = backward_blocks(em)
    d_x = grads[0]
    output = em.name(p.output)
    extra_inputs = [extra_input_name(op) for op in p.ops if op.extra_input is not None]
    # in number order: the public ones, then the hidden ones of ops that write back (Op.writes_back_to)
    tees = sorted((op for op in p.ops if op.extra_output is not None), key=lambda op: op.extra_output)
    extra_outputs = [extra_output_name(op) for op in tees]
    params = [(op, attr, key, shape, init, param_name(op, attr)) for op, attr, key, shape, init in p.params]
    saved_values = saved_for_backward(plan, em, bwd)
    saved = [em.name(value) for value in saved_values]
    modules = {}
    for op, attr, key, shape, init, name in params:
        modules.setdefault(op.module_index, []).append((attr, shape, init, name, *placement(op)))
    leads, lead_lines = leading_dims(p)
    modules_run, per_row = user_modules(p), row_inputs(p)
    cells = runs_as(plan, stage_kernels)
    grad_outputs = ["d_" + output] + ["d_" + e for e in extra_outputs]
    # the Function's forward and the no-grad forward take the pipeline's free values (convention.py);
    # an extra input written back that the backward reads is a copy (the caller's tensor changes after it)
    copied = {p.extra_input_values[op.writes_back_to] for op in p.written_back
              if p.extra_input_values[op.writes_back_to] in plan.saved_extra_inputs}
    args = convention.arguments(p, leads, copied)
    grad_inputs = convention.grad_inputs(args, d_x)
    between = any(stage.rule.stage.between_functions for stage in plan.forward)
    if not between:  # one Function returns every grad (segments gives each Function its own copies)
        copies = own_memory(em, [g for g in grad_inputs if g != "None"])
        bwd += [copies] if copies else []
    weight_grads = {name for block in bwd for name, _ in block.weight_grads}
    function_inputs = [arg.name for arg in args]
    no_grad = no_grad_blocks(plan, stage_kernels)
    functions, grad_steps = (segments(plan, em, fwd, bwd, grads, saved_values, tees, [arg.value for arg in args])
                             if between else ([], []))
    return dict(
        traffic=traffic_cells(plan), spec_rows=spec_rows(p, extra_inputs),
        pipeline=p, plan=plan, forward=fwd, backward=bwd, output=output,
        function_returns=distinct_returns([output] + extra_outputs, em.aliases),
        no_grad=no_grad, no_grad_fuses_more=plan.inference != plan.forward,
        extra_inputs=extra_inputs, extra_outputs=extra_outputs, params=params,
        public_extra_outputs=[op for op in tees if op.writes_back_to is None],
        written_back=[(op, extra_inputs[op.writes_back_to]) for op in p.written_back],  # the extra inputs written back
        caller_tensors=convention.caller_tensors(args), passed_lines=convention.passed_lines(args),
        tensor_arguments=[arg.name for arg in args if arg.tensor],
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
        functions=functions, grad_steps=grad_steps,
        cuda_graphs=graphs, function_inputs=function_inputs,
        no_grad_op=no_grad_op(p.name, args, no_grad, [output] + extra_outputs) if graphs else None,
        leads=leads, lead_lines=lead_lines, any_shape=takes_any_shape(p),
        # check_parameters' arguments: the parameters' state_dict keys, their shapes, their names
        parameter_check=[_tuple_literal(f'"{key}"' for _, _, key, *_ in params),
                         _tuple_literal(repr(tuple(shape)) for *_, shape, _, _ in params),
                         _tuple_literal(name for *_, name in params)],
        kernels=stage_kernels, runs_as=cells, diagrams=diagrams(plan, cells, extra_inputs, extra_outputs),
    )


def diagrams(plan: Plan, cells: dict, extra_inputs: list[str], extra_outputs: list[str]) -> dict[str, str]:
    """The plan's Mermaid flowcharts: forward in the order it runs, backward likewise (last stage first)."""
    return {"forward": flowchart("f", list(enumerate(plan.forward)), cells, "forward", extra_inputs, extra_outputs),
            "backward": flowchart("b", list(reversed(list(enumerate(plan.backward)))), cells, "backward",
                                  extra_inputs, extra_outputs)}
