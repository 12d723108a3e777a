"""A pipeline's FP8 emission (issue 40, built for [tool.fusegen] fp8): its stages lowered once more
with the GEMM stages through the runtime's Fp8Call, as a Function of its own and a no-grad forward;
the GEMMs' and the spec's Quantize ops' FP8 state holders; plan.md's FP8 section's parts."""

from __future__ import annotations

from ..ops.identity import quantize_points
from ..plan import Plan
from ..calls import TorchCall
from ..stages import Block, Emitter
from ..stages.gemm import gemm_ops
from . import convention
from .blocks import backward_blocks, distinct_returns, forward_blocks, own_memory, saved_for_backward
from .function import function_parts
from .segments import segments
from .held import child_module, te_holder


def fp8_parts(plan: Plan, stage_kernels: dict, p, function_inputs: list[str], args, output: str,
              extra_outputs: list[str], tees: list, blocks: list, width: str | None) -> dict:
    """The pipeline's FP8 emission (built for [tool.fusegen] fp8): its stages once more with the
    GEMM stages through the runtime's Fp8Call (the stages' last argument, ``fp8``), as a Function of
    its own (with user modules, a Function around each run of fused stages and grad_forward_fp8's
    steps) and a no-grad forward, a spec Quantize at an end a round trip through FP8; what the
    module needs to make the call (fp8.py's fp8_call): each GEMM's holder of TE's FP8 state and
    the GEMM's index there, and the Quantizes' states."""
    em = Emitter(plan, stage_kernels, fp8=True)
    quantizes = fp8_quantizes(p)
    ends = {mode for _, _, _, points in quantizes for target, mode in points if target == ENDS[mode]}
    fwd = forward_blocks(em)
    y = _round_trip(em, fwd, "forward", p.output, p.output) if "forward" in ends else p.output
    bwd, grads = backward_blocks(em)
    dx = _round_trip(em, bwd, "backward", grads[0], 0) if "backward" in ends and grads[0] is not None else grads[0]
    saved_values = saved_for_backward(plan, em, bwd)
    saved = [em.name(value) for value in saved_values]
    # what the high-precision Function keeps that this one does not: GEMM inputs it keeps in FP8
    not_kept = [em.table[value].name for value in plan.saved_values if value not in saved_values]
    if any(stage.rule.stage.between_functions for stage in plan.forward):
        # user modules: a Function of FP8 stages between each two (segments.py), run by grad_forward_fp8
        functions, grad_steps = segments(plan, em, fwd, bwd, grads, saved_values, tees,
                                         [arg.value for arg in args] + [em.fp8], kind="Fp8")
        # delayed scaling's update after the backward once a call: in the Function with the call whose
        # backward runs last (the first)
        last = min(k for k, function in enumerate(functions) if function["fp8"] in function["saved"])
        for k, function in enumerate(functions):
            function["fp8"] = function["fp8"] if k == last else None
    else:
        grad_outputs = [em.grad(p.output)] + [em.grad(op.extra_out) for op in tees]
        grad_inputs = convention.grad_inputs(args, dx, em.grad) + [None]  # (none for fp8)
        copies = own_memory(em, [g for g in grad_inputs if g is not None])
        bwd += [copies] if copies else []
        functions = [function_parts(
            em, f"{p.class_name}Fp8Function", f"`{p.name}` (FP8 GEMMs)", "The stages above with FP8 GEMMs "
            "(``graph``: None, FP8 calls replay no CUDA graphs yet).", "_fp8", function_inputs + ["fp8"], fwd,
            distinct_returns([em.name(y)] + extra_outputs, em.aliases), saved, grad_outputs, bwd, grad_inputs, width,
            tuple((em.grad(param.op.param(param.attr)), param.block_rows()) for param in blocks))]
        grad_steps = []
    no_grad_kernels = {("forward", start): specs for (pass_, start), specs in stage_kernels.items()
                       if pass_ == "inference"}
    no_grad_em = Emitter(plan, no_grad_kernels, saving=False, fp8=True)
    no_grad = forward_blocks(no_grad_em, plan.inference, "no-grad")
    no_grad_y = _round_trip(no_grad_em, no_grad, "forward", p.output, p.output) if "forward" in ends else p.output
    gemms = fp8_gemms(p)
    # plan.md's table: each GEMM's op and the values cast for it (x and, backward, the output's grad)
    kept_by = {em.table[value].name: kernel for value, (_, kernel) in em.fp8_amaxes.items()}  # amaxes kept
    written_by = {em.table[value].name: kernel for value, kernel in em.fp8_written.items()}  # FP8 variants
    table = [(n, op.number, op.describe(), em.table[op.input].name, em.table[op.output].name, kept_by, written_by)
             for n, op in enumerate(gemm_ops(p))]
    return dict(functions=functions, grad_steps=grad_steps, no_grad=no_grad,
                no_grad_returns=[no_grad_em.name(no_grad_y)] + extra_outputs, recipes=repr(p.fp8.recipes),
                min_rows=p.fp8.min_rows, names=list(p.fp8.recipes), table=table, gemms=gemms, not_kept=not_kept,
                paths=repr(tuple((path, index) for _, path, index, _, _ in gemms)), quantizes=quantizes,
                quantize_points=repr(tuple((gemm, mode, path) for _, path, _, points in quantizes
                                           for gemm, mode in points)))


# what a spec Quantize at an end of the pipeline casts, by mode: the output (forward, the last op),
# x's grad (backward, the first op); TE hands the caller that FP8 tensor
ENDS = {"forward": "y", "backward": "dx"}


def _round_trip(em: Emitter, blocks: list, mode: str, value: int, like: int) -> int:
    """A spec Quantize at the pipeline's end: ``value`` (the output, or x's grad) cast to FP8 with
    the Quantize's scaling state and back, in a block after ``blocks``' (the values TE hands the
    caller as an FP8 tensor). Returns the new value (``like``: the value it stands for)."""
    grad_of = em.table[value].grad_of
    kind = em.table[like]
    new = em.table.add(kind.role, kind.dtype, f"{em.name(value)}_through_fp8", kind.features, grad_of=grad_of)
    title = ("the spec's Quantize at the pipeline's end: the output" if mode == "forward" else
             "the spec's Quantize at the pipeline's start: x's grad")
    block = Block(title + ", cast to FP8 and back (TE hands the caller the FP8 tensor)", name=em.name)
    block.add(TorchCall(f"{{new}} = {{fp8}}.round_trip({ENDS[mode]!r}, {{value}})", dict(fp8=em.fp8, value=value),
                        dict(new=new)))
    blocks.append(block)
    return new


def fp8_quantizes(p) -> list[tuple[str, str, tuple[int, int], list[tuple[int | str, str]]]]:
    """The spec's Quantize ops (TE's cast points) of a pipeline built for FP8, each with its scaling
    state (TE's: one quantizer a mode it casts in): (its holder's expression, its path, its (forward,
    backward) slots, and what it casts: (the GEMM's number, or "y" / "dx" at the pipeline's ends
    (ENDS); "forward": the GEMM's x, or "backward": its output's grad)). build.with_fp8
    checked that each sits next to its Linear or at an end."""
    numbers = {op.node: n for n, op in enumerate(gemm_ops(p))}
    out: dict[str, list] = {}
    for node, mode, linear in quantize_points(p.graph):
        entry = out.setdefault(node.module_index, [child_module(node.module_index), node.module_index, [0, 0], []])
        entry[2][0 if mode == "forward" else 1] = 1
        entry[3].append((ENDS[mode] if linear is None else numbers[linear.index], mode))
    return [(holder, path, tuple(slots), points) for holder, path, slots, points in out.values()]


def fp8_gemms(p) -> list[tuple[str, str, int, int, bool]]:
    """Each GEMM's FP8 state as the module holds it, in the plan's order: (the expression of its
    holder, its path in the module (get_submodule's), the GEMM's index there, the holder's GEMMs,
    whether the holder is one of TE's modules). The holder is the child (or TE submodule) that
    holds the weight: a TE module keeps its GEMMs' state together (its _extra_state), as te.ops'
    Linear its one."""
    gemms, counts = [], {}
    for op in gemm_ops(p):
        *submodules, _ = op.holder_attribute("weight").split(".")
        holder = child_module(op.module_index) + "".join(f'._modules["{name}"]' for name in submodules)
        path = ".".join([op.module_index, *submodules])
        te_module = bool(submodules) or te_holder(op.spec_op) == "TeModuleOp"
        gemms.append((holder, path, counts.get(holder, 0), te_module))
        counts[holder] = counts.get(holder, 0) + 1
    return [(holder, path, index, counts[holder], te_module) for holder, path, index, te_module in gemms]


def fp8_children(children_: list, p) -> list:
    """``children``' entries with the class of a te.ops child that holds an FP8 GEMM's state
    Fp8SpecOp (a SpecOp with TE's _extra_state)."""
    holders = {op.module_index for op in gemm_ops(p)} | {path for _, path, _, _ in fp8_quantizes(p)}
    return [(*entry[:6], "Fp8SpecOp" if entry[6] == "SpecOp" and entry[0] in holders else entry[6], *entry[7:])
            for entry in children_]
