"""The context of a pipeline's files (pipeline.py.j2, plan.md.j2): its blocks, its calling
convention, its saved tensors, its module's children and checks, whether it replays CUDA graphs."""

from __future__ import annotations

import hashlib
import inspect

from .. import tensor_parallel
from ..ir import Sym, size_expr
from ..kernels import DTYPES
from ..ops import part_submodule
from ..plan import Plan
from ..source_text import py_string
from ..stages import Block, Emitter
from ..stages.base import extra_input_name, extra_output_name, param_name
from ..stages.module import lead_name, module_name
from . import convention
from .blocks import (backward_blocks, distinct_returns, forward_blocks, no_grad_blocks, own_memory, reads_of,
                     saved_for_backward)
from .compiled import training_ops
from .fp8 import fp8_children, fp8_parts
from .function import function_parts
from .held import child_module, held_parameters, runtime_helpers, te_holder
from .plan_doc import diagrams, runs_as, saved_table, spec_rows, traffic_cells
from .segments import segments


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
            named = list(inspect.signature(helper).parameters)[:2] == ["module", "op"]  # (a helper that can fail)
            where = f'"{p.class_name}", {call}, ' if named else ""
            lines.append(f"{new} = ref.{helper.__name__}({where}{current}, {dims!r})")
            current = new
    names[len(p.ops)] = current
    return names, lines


def user_modules(pipeline) -> list:
    """The ops that run a module of the user's code (ops/module.py)."""
    return [op for op in pipeline.ops if op.opdef.user_module]


def row_inputs(pipeline) -> list:
    """The ops whose extra input holds one value per row (a row-scaled activation's scales)."""
    return [op for op in pipeline.ops if op.opdef.operand is not None and op.opdef.operand.broadcast == "row"]


def _sizes_literal(sizes) -> str:
    """A tuple literal of feature sizes: ints, "rows" (one value per row), (size-generic) their
    expressions in n, 'n // 2', or None after a Reshape whose last dim is known only at run time."""
    return repr(tuple(size if isinstance(size, (int, str)) else size_expr(size, "n", "//") if size.of_input else None
                      for size in sizes))


def spec_position(path: str) -> tuple[int, ...]:
    """An op's ``module_index`` ("0.1") as a sort key: a Residual before its ops, "2" before "10"."""
    return tuple(int(part) for part in path.split("."))


def children(pipeline, params: dict, modules_run: list) -> list:
    """The module's children, one per op of the spec's Sequential in order, a Residual's ops its
    own children (as the eager module nests them): (path, the op's call as the spec writes it,
    its parameters, the Op when it is a module of the user's code, the parent's path, its name
    in the parent, the runtime's class that holds it), parents first."""
    calls: dict[str, str] = {}
    holders: dict[str, str] = {}  # the runtime's class of each child: a TE module's keeps TE's _extra_state
    submodules: dict[str, list[str]] = {}  # TE's submodules of a module built of them (te.MultiheadAttention)
    for node in pipeline.graph.nodes:
        calls.setdefault(node.module_index, node.module_call)
        holders.setdefault(node.module_index, te_holder(node.spec_op))
        inner = submodules.setdefault(node.module_index, [])
        submodule = part_submodule(node.part)
        nested = submodule.split(".") if submodule else []
        for depth in range(1, len(nested) + 1):  # "self_attention", then "self_attention.proj"
            if ".".join(nested[:depth]) not in inner:
                inner.append(".".join(nested[:depth]))
    users = {op.module_index: op for op in modules_run}
    return [(path, call, params.get(path, []), users.get(path), *_parent_and_name(path), holders[path],
             _submodule_holders(submodules[path]))
            for path, call in sorted(calls.items(), key=lambda item: spec_position(item[0]))]


def _submodule_holders(submodules: list[str]) -> list[tuple[str, str, str]]:
    """(parent's attribute path, name, the runtime's class) of each of TE's submodules, parents
    first: a TE module (TeModuleOp, its _extra_state) or one built of TE's modules, which holds
    others (SpecOp: te.TransformerLayer's self_attention)."""
    holders = []
    for submodule in submodules:
        parent, _, name = submodule.rpartition(".")
        composite = any(other.startswith(f"{submodule}.") for other in submodules)
        holders.append((f".{parent}" if parent else "", name, "SpecOp" if composite else "TeModuleOp"))
    return holders


def _parent_and_name(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition(".")
    return parent, name


def replays_graphs(plan: Plan) -> bool:
    """Whether the module replays its forward and backward from CUDA graphs at a few rows (the
    runtime's CudaGraphs): worth it from two launches on, where a graph can capture every stage
    (in some dtypes only, where a stage says so: ``replay_dtypes``)."""
    launching = [s for s in plan.inference if s.rule.stage.launches and s.kind != "passthrough"]
    every = [*plan.inference, *plan.forward, *plan.backward]
    return len(launching) >= 2 and all(s.rule.stage.replayable for s in every)


def replay_dtypes(plan: Plan) -> tuple[str, ...] | None:
    """The dtypes of x in which every stage can be captured (the stages' ``replay_dtypes`` in
    common, in DTYPES' order), or None for any."""
    every = [s.rule.stage.replay_dtypes for s in [*plan.inference, *plan.forward, *plan.backward]]
    declared = [set(dtypes) for dtypes in every if dtypes is not None]
    if not declared:
        return None
    return tuple(name for name in DTYPES if all(name in dtypes for dtypes in declared))


def graphs_arguments(args: list[convention.Argument], dtypes: tuple[str, ...] | None, compiled: bool = False) -> str:
    """CudaGraphs' arguments after the module's name: how many tensors the caller hands, the
    positions of the tensors made per call (the packed sequences' offsets; ``compiled``: of the
    graphs torch.compile's op replays), the dtypes a graph can capture in."""
    text = f"inputs={len(convention.caller_tensors(args))}"
    per_call = convention.per_call_positions(args, compiled)
    if per_call:
        text += f", per_call={per_call!r}"
    return text + dtypes_argument(dtypes)


def dtypes_argument(dtypes: tuple[str, ...] | None) -> str:
    """``, dtypes=(torch.bfloat16, ...)``: the dtypes a module's graphs (CudaGraphs, and its
    compiled passes' PassGraphs) capture in; nothing where every dtype can be captured."""
    if dtypes is None:
        return ""
    return ", dtypes=(" + ", ".join(f"torch.{name}" for name in dtypes) + ("," if len(dtypes) == 1 else "") + ")"


def no_grad_op(name: str, args: list[convention.Argument], blocks: list[Block], outputs: list[str]) -> tuple[str, str]:
    """torch.compile's custom op for a graph-replaying pipeline's no-grad forward (in the "fusegen"
    namespace): its name, the pipeline's and a digest of the function's arguments, lines and
    returns (packages that hold the same pass share its op, and a changed pass gets a new one),
    and its schema."""
    text = "\n".join([convention.schema_arguments(args), *(line for block in blocks for line in block.lines), *outputs])
    return (f"{name}_no_grad_{hashlib.sha256(text.encode()).hexdigest()[:8]}",
            convention.schema(args, len(outputs)))


def pipeline_context(plan: Plan, stage_kernels: dict) -> dict:
    p = plan.pipeline
    graphs = replays_graphs(plan)
    em = Emitter(plan, stage_kernels)  # the stages run in functions of their own (function.py)
    fwd = forward_blocks(em)
    bwd, grads = backward_blocks(em)
    output = em.name(p.output)
    extra_inputs = [extra_input_name(op) for op in p.ops if op.extra_input is not None]
    # in number order: the public ones, then the hidden ones of ops that write back (Op.writes_back_to)
    tees = sorted((op for op in p.ops if op.extra_output is not None), key=lambda op: op.extra_output)
    extra_outputs = [extra_output_name(op) for op in tees]
    # each parameter's attribute on the child that holds it (a TE module's: fc1_weight)
    params = [(op, op.holder_attribute(attr), key, shape, init, param_name(op, attr))
              for op, attr, key, shape, init in p.params]
    saved_values = saved_for_backward(plan, em, bwd)
    saved = [em.name(value) for value in saved_values]
    held = held_parameters(p)
    held_locals = {param.name: [local for *_, local in param.tensors] for param in held}
    modules = {}  # each child's lines creating the parameters it holds
    for param in held:
        modules.setdefault(param.op.module_index, []).extend(param.init_lines())
    leads, lead_lines = leading_dims(p)
    modules_run, per_row = user_modules(p), row_inputs(p)
    cells = runs_as(plan, stage_kernels)
    grad_outputs = [em.grad(p.output)] + [em.grad(op.extra_out) for op in tees]
    # the Function's forward and the no-grad forward take the pipeline's free values (convention.py);
    # an extra input written back that the backward reads is a copy (the caller's tensor changes after it)
    copied = {p.extra_input_values[op.writes_back_to] for op in p.written_back
              if p.extra_input_values[op.writes_back_to] in plan.saved_extra_inputs}
    args = convention.arguments(p, leads, copied, lead_lines, graphs=graphs)
    grad_inputs = convention.grad_inputs(args, grads[0], em.grad)
    between = any(stage.rule.stage.between_functions for stage in plan.forward)
    if not between:  # one Function returns every grad (segments gives each Function its own copies)
        copies = own_memory(em, [g for g in grad_inputs if g is not None])
        bwd += [copies] if copies else []
    function_inputs = [arg.name for arg in args]
    no_grad = no_grad_blocks(plan, stage_kernels)
    # TE's row blocks: the module's one Function takes them after its stages' arguments (held.py)
    blocks = [] if between else [param for param in held if param.blocks]
    if between:
        functions, grad_steps = segments(plan, em, fwd, bwd, grads, saved_values, tees, [arg.value for arg in args])
    else:
        doc = ("The stages above, replayed from CUDA graphs at a few rows (``graph``: the module's\n    "
               "CudaGraphs.training, or None)." if graphs else "The stages above (``graph``: None, the module replays "
               "no CUDA graphs).")
        takes_n = p.input_width is not None and p.input_width in reads_of(bwd)
        functions = [function_parts(
            em, f"{p.class_name}Function", f"`{p.name}`", doc, "", function_inputs, fwd,
            distinct_returns([output] + extra_outputs, em.aliases), saved, grad_outputs, bwd, grad_inputs,
            "args[0].shape[1]" if takes_n else None,
            tuple((em.grad(param.op.param(param.attr)), param.block_rows()) for param in blocks))]
        grad_steps = []
    fp8 = fp8_parts(plan, stage_kernels, p, function_inputs, args, output, extra_outputs, tees, blocks,
                    "args[0].shape[1]" if not between and takes_n else None) if p.fp8 else None
    return dict(
        traffic=traffic_cells(plan), spec_rows=spec_rows(p, extra_inputs),
        pipeline=p, plan=plan, output=output, no_grad=no_grad, no_grad_fuses_more=plan.inference != plan.forward,
        extra_inputs=extra_inputs, extra_outputs=extra_outputs, params=params,
        public_extra_outputs=[op for op in tees if op.writes_back_to is None],
        written_back=[(op, extra_inputs[op.writes_back_to]) for op in p.written_back],  # the extra inputs written back
        caller_tensors=convention.caller_tensors(args), passed_lines=convention.passed_lines(args),
        # autocast casts what the module holds (TE's row blocks, before they are joined)
        tensor_arguments=[local for arg in args if arg.tensor for local in held_locals.get(arg.name, [arg.name])],
        reset_lines=[line for param in held for line in param.reset_lines()],
        read_lines=[line for param in held for line in param.read_lines()],
        handed_lines=[line for param in held for line in param.handed_lines(not between)],
        function_blocks="".join(f", {local}" for param in blocks for local in param.block_locals()),
        adjacent_blocks=[(param.holder(), param.block_attributes()) for param in held if param.blocks],
        extra_input_features=_sizes_literal("rows" if op in per_row else op.in_features
                                            for op in p.ops if op.extra_input is not None),
        extra_output_features=_sizes_literal(p.graph.features(v) for v in p.graph.outputs[1:]),
        children=fp8_children(children(p, modules, modules_run), p) if p.fp8 else children(p, modules, modules_run),
        saved_table=saved_table(plan, em, saved, params),
        user_modules=[(op, module_name(op), lead_name(op)) for op in modules_run],
        functions=functions, grad_steps=grad_steps,
        cuda_graphs=graphs, function_inputs=function_inputs,
        graphs_arguments=graphs_arguments(args, replay_dtypes(plan)) if graphs else "",
        compiled_graphs_arguments=graphs_arguments(args, replay_dtypes(plan), compiled=True) if graphs else "",
        pass_graphs_dtypes=dtypes_argument(replay_dtypes(plan)) if graphs else "",
        no_grad_op=no_grad_op(p.name, args, no_grad, [output] + extra_outputs) if graphs else None,
        # torch.compile's forward and backward ops under autograd, where the module replays graphs
        training_ops=training_ops(p.name, args, functions[0]) if graphs and not grad_steps else None,
        leads=leads, any_shape=convention.takes_any_shape(p),
        forward_parameters=convention.forward_parameters(args, convention.te_masks(p)),
        # the module forward's checks of its arguments
        check_lines=convention.check_lines(args, lead_lines) + convention.ignored_sequences_lines(p.class_name, args),
        check_helpers=sorted(convention.check_helpers(args) + runtime_helpers(held, not between)),
        kernels=stage_kernels, runs_as=cells, diagrams=diagrams(plan, cells, extra_inputs, extra_outputs),
        fp8=fp8, shards=tensor_parallel.shards(p),
        # TE's "sbhd": x [seq, batch] transposed to batch-major rows inside, and the output back (not under
        # sequence parallelism, where the rows run as x's: tensor_parallel.sequence_major)
        batch_major_inside=p.sequence_format == "sbhd" and not tensor_parallel.sequence_major(p),
    )
