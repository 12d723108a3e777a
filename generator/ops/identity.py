"""Views: ops that move no data.

Identity: y = x. A view in the graph IR; the planner's chain (pipeline.py) drops it (it would only
break fusion windows), so it has no reference math and no functor.

Reshape(shape): y = x.reshape(shape) (catalog 2.9), backward the grad reshaped back. The running
tensor's last dim becomes ``shape[-1]`` and its leading dims ``shape[:-1]`` (one dim may be -1; a
-1 last dim is the width torch infers: fixed by an op after it that needs one, else known at run
time, a size-generic width of its own, ``reshapeK_width`` in the generated module); its
stage (stages/reshape.py) reshapes the 2-D [rows, features] tensors fused stages work on, and the
generated module gives its outputs the leading dims the reshape made. As in TE it breaks fusion
windows.

FlattenRows(dims) and UnflattenRows(dims): the views around an op that reads several trailing dims
as one row (``OpDef.row_shape``: a norm's multi-dim normalized_shape). No spec names them; the graph
puts them around such an op (``around_rows``), so its kernel sees rows of prod(dims) features and
the ops after it the last dim again. They run as Reshapes do (the reshape stage), and the
generated module checks that the leading dims end in dims[:-1] (``flattened_lead``).
"""

import math

from .common import flattened_lead, unflattened_lead
from .opdef import MAX_FEATURES, Arg, OpDef, register

register(OpDef("Identity", "identity", summary="y = x", changes_value=False, changes_grad=False, view=True))

# TE's te.ops.Quantize (ops/basic/quantize.py): outside autocast y = x; inside it, the FP8 cast of
# the tensor (forward) and of its grad (backward) with the op's own quantizers, whose FP8 tensor
# the Linear next to it takes as its operand (a Linear casts no operand that is FP8 already). A
# view here: the pipeline built for FP8 runs it as that Linear's cast of the operand with the
# Quantize's scaling state (quantize_points; its _extra_state is TE's), so values are TE's.
register(OpDef(
    "Quantize", "quantize", args=(Arg("forward", "bool", True, in_kernel=False), Arg("backward", "bool", False,
                                                                               in_kernel=False)),
    summary="y = x; inside the package's autocast, the FP8 cast of the next Linear's input (forward) or of "
            "the previous Linear's output grad (backward), with the Quantize's own scaling state",
    changes_value=False, changes_grad=False, view=True))


def quantize_points(graph) -> list[tuple[object, str, object | None]]:
    """Each cast a Quantize of ``graph`` makes: (its node, "forward" (it casts the input of the
    Linear right after it) or "backward" (the grad of the output of the Linear right before it),
    that Linear's node, or the op's there if not a Linear). Views between them are skipped; a
    Quantize at either end of the chain has None there."""
    nodes = list(graph.nodes)
    points = []
    for i, node in enumerate(nodes):
        if node.opdef.kind != "quantize":
            continue
        after = next((n for n in nodes[i + 1:] if not n.opdef.view), None)
        before = next((n for n in reversed(nodes[:i]) if not n.opdef.view), None)
        for mode, neighbour in (("forward", after), ("backward", before)):
            if node.args[mode]:
                points.append((node, mode, neighbour))
    return points


def _check_shape(shape):
    if shape.count(-1) > 1:
        return "may hold -1 at most once (the one size torch infers)"
    if any(d < -1 or d == 0 for d in shape):
        return "must hold positive sizes (and at most one -1)"
    if shape[-1] > MAX_FEATURES:
        return f"must give a last dim of at most {MAX_FEATURES} (fusegen's bound on feature sizes)"
    return None


def _check_sizes(a, n_in, n_out):
    """Where the input's width and the output's are both known (a -1 last dim fixed by an op after
    the Reshape) and so are the leading dims, the elements it makes must be whole rows of the input."""
    shape = a["shape"]
    if -1 in shape[:-1] or not isinstance(n_in, int) or not isinstance(n_out, int):
        return None
    made = math.prod(shape[:-1]) * n_out
    if made % n_in:
        return (f"makes {list(shape[:-1]) + [n_out]} ({made} elements; {n_out}, the features the ops after it "
                f"take, as its last dim), which no number of its input's rows of {n_in} features gives; make "
                "the sizes agree")
    return None


register(OpDef(
    "Reshape", "reshape", args=(Arg("shape", "dims", check=_check_shape),),
    # a -1 last dim (RUN_TIME): the width torch infers from the elements it receives, known at run
    # time unless an op after it fixes it (ir._infer_sizes)
    fixed_out=lambda a: a["shape"][-1], out_features=lambda a, n: a["shape"][-1], reshape=lambda a: a["shape"],
    check_sizes=_check_sizes,
    tag=lambda a: "reshape", summary="y = x.reshape(shape)", changes_value=False, changes_grad=False,
))


_DIMS = (Arg("dims", "dims"),)
FLATTEN_ROWS = register(OpDef(
    "FlattenRows", "reshape", args=_DIMS, modules=(),
    fixed_in=lambda a: a["dims"][-1], out_features=lambda a, n: math.prod(a["dims"]),
    new_lead=lambda a: (flattened_lead, a["dims"]), tag=lambda a: "reshape",
    summary="the last len(dims) dims as one: y = x.reshape(*x.shape[:-len(dims)], prod(dims))",
    changes_value=False, changes_grad=False,
))
UNFLATTEN_ROWS = register(OpDef(
    "UnflattenRows", "reshape", args=_DIMS, modules=(),
    fixed_in=lambda a: math.prod(a["dims"]), out_features=lambda a, n: a["dims"][-1],
    new_lead=lambda a: (unflattened_lead, a["dims"]), tag=lambda a: "reshape",
    summary="FlattenRows undone: y = x.reshape(*x.shape[:-1], *dims)", changes_value=False, changes_grad=False,
))


def around_rows(op: OpDef, args: dict) -> list[tuple[OpDef, dict]]:
    """A basic op as the graph runs it: between FlattenRows and UnflattenRows where it reads
    several trailing dims as one row (``OpDef.row_shape``), else as it is."""
    dims = op.row_shape(args)
    if dims is None:
        return [(op, args)]
    return [(FLATTEN_ROWS, {"dims": dims}), (op, args), (UNFLATTEN_ROWS, {"dims": dims})]
