"""Linear layers: BasicLinear (y = x W^T) and Linear (BasicLinear followed by Bias).

GEMMs run in cuBLAS through torch (the gemm stages), so these ops have no device functor.
The reference functions below are shipped by source into the output's ``_reference.py``
(ops/shipped.py): they may use only ``torch``, ``math`` and other shipped functions.
"""

from .lazy import torch
from .opdef import (DEVICE, DTYPE, LINEAR_PARALLEL, MODULE_PARALLEL_MODE, TP_SIZE, Arg, OpDef, Param, check_features,
                    register)

# TE's accumulate_into_main_grad: the weight gradient is added into ``weight.main_grad``.
MAIN_GRAD = Arg("accumulate_into_main_grad", "bool", False, keyword_only=True, in_kernel=False)


def linear(x, weight):
    return x @ weight.t()


def linear_bwd(dy, x, weight):
    """(dx, dweight) of y = x W^T for 2-D x, dy."""
    return dy @ weight, dy.t() @ x


def accumulate_into_main_grad(weight, dy, x, alpha=1.0):
    """TE's accumulate_into_main_grad (catalog 2.1): dW = alpha dy^T x is added into ``weight.main_grad``
    in that tensor's dtype (float32, as Megatron keeps it). Returns what autograd gets as the
    weight's grad (_main_grad_result)."""
    main_grad = _main_grad_of(weight)
    main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype), alpha=alpha)
    return _main_grad_result(weight)


def add_into_main_grad(weight, dw):
    """accumulate_into_main_grad for a weight grad ``dw`` computed already (an FP8 GEMM's, in fp32)."""
    main_grad = _main_grad_of(weight)
    main_grad.add_(dw.to(main_grad.dtype))
    return _main_grad_result(weight)


def _main_grad_of(weight):
    """``weight.main_grad``, checked: there, and of the weight's shape."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            "a Linear with accumulate_into_main_grad=True adds its weight gradient into weight.main_grad, "
            "but the weight has no main_grad: set weight.main_grad to a tensor of the weight's shape "
            "(usually float32, zeroed per step) before backward, as Megatron's DDP does")
    if tuple(main_grad.shape) != tuple(weight.shape):
        raise RuntimeError(f"weight.main_grad has shape {list(main_grad.shape)}, but the weight is "
                           f"{list(weight.shape)}; give it the weight's shape")
    return main_grad


def _main_grad_result(weight):
    """What autograd gets as a weight's grad once it is in ``weight.main_grad``: with Megatron's
    ``grad_added_to_main_grad`` attribute, that flag set and a placeholder (zeros when
    ``weight.zero_out_wgrad``), else None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    placeholder = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return placeholder(weight.shape, dtype=weight.dtype, device=weight.device)


def weight_grad(ctx, weight, dy, x, alpha=1.0):
    """The weight's grad alpha dy^T x, for autograd to accumulate into ``weight.grad`` (``ctx``: the
    backward's autograd.Function context).

    Where autograd would add it into a grad already there (a later micro-batch, a second call),
    the GEMM adds it there itself (beta = 1) and hands autograd the sum with ``weight.grad`` set
    to None, which autograd takes back as the grad as it is: the same values in the same memory,
    without a parameter-sized temporary and a separate add (a sixth of the device time of a TE MLP
    training step at a few rows)."""
    grad = _grad_to_add_into(ctx, weight, x)
    if grad is not None:  # (its .grad now None: autograd takes the sum back as it is)
        return grad.addmm_(dy.t(), x, alpha=alpha)
    if alpha == 1.0:
        return dy.t().mm(x)
    return torch.addmm(dy.new_zeros(()), dy.t(), x, beta=0, alpha=alpha)  # beta = 0: C is never read


def _grad_to_add_into(ctx, weight, x):
    """``weight.grad`` where weight_grad's GEMM may add into it, else None. Not where anything would
    see the difference: a hook on the weight (it sees the increment), torch.autograd.grad or
    backward(inputs=...) that leaves the weight's grad alone, create_graph (the grad is then
    differentiable), torch.compile's tracing, or a grad that is a view (DDP's bucket views), of
    another dtype or layout, or itself differentiable. A weight joined from TE's row blocks, which
    the Function takes after its stages' arguments (its forward's ``ctx.row_blocks``): the blocks'
    grads as one tensor of the weight's shape, where each block's is as a weight's must be and they
    follow one another in one buffer (as the Function's split_rows handed them out and autograd
    kept them). The grads it returns are set to None: autograd takes the sum back as it is."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled():
        return None
    # (a joined view needs no grad itself: a weight that does is no blocks' join)
    blocks = None if weight.requires_grad else _row_blocks_of(ctx, weight)
    following = ctx.next_functions  # (a tuple built per read: read once)
    if blocks is None:  # its AccumulateGrad node among the Function's next ones
        tensors = (weight,)
        nodes = [next((node for node, _ in following if getattr(node, "variable", None) is weight), None)]
    else:  # the blocks' nodes: those of the Function's inputs from ``first`` (from the end) on
        first, tensors = blocks
        nodes = [node for node, _ in following[first:first + len(tensors) or None]]
    grads = [_accumulated_grad(node, tensor, x, views=blocks is not None) for node, tensor in zip(nodes, tensors)]
    if any(grad is None for grad in grads):
        return None
    if blocks is not None:  # the blocks' grads one after another in one buffer
        address = grads[0].data_ptr()
        for grad in grads:
            if grad.data_ptr() != address:
                return None
            address += grad.nbytes
        storage = grads[0].untyped_storage()
        if address > storage.data_ptr() + storage.nbytes():
            return None
    for tensor in tensors:
        tensor.grad = None
    return grads[0] if blocks is None else grads[0].as_strided(weight.shape, weight.stride())


def _row_blocks_of(ctx, weight):
    """(the position of the first among the Function's inputs, counted from the last: negative,
    the blocks) of the row blocks a Function took for ``weight`` (its forward's ``ctx.row_blocks``:
    TE's blocks, which the stages read joined, a view at the first one's address), or None."""
    held = getattr(ctx, "row_blocks", ())  # (none on torch.compile's ctx: weight may be fake there)
    if not held:
        return None
    address, rows = weight.data_ptr(), weight.shape[0]
    return next(((first, blocks) for first, blocks in held if blocks[0].data_ptr() == address
                 and sum(block.shape[0] for block in blocks) == rows), None)


def _accumulated_grad(accumulator, tensor, x, views=False):
    """``tensor.grad`` (a parameter the Function took) where the running backward accumulates into
    it (``accumulator``: its AccumulateGrad node among the Function's next ones, executed) and an
    add in place would go unseen (_grad_to_add_into), else None. ``views``: the grad may be a view
    (TE's row blocks' grads are slices of one buffer)."""
    # (an AccumulateGrad node of its own: a leaf that requires grad)
    if getattr(accumulator, "variable", None) is not tensor or tensor._backward_hooks:
        return None
    grad = tensor.grad
    if (grad is None or grad.dtype != x.dtype or grad.device != x.device
            or grad.layout != torch.strided or (grad._base is not None and not views)
            or not grad.is_contiguous() or grad.requires_grad):
        return None
    try:
        return grad if torch._C._will_engine_execute_node(accumulator) else None
    except RuntimeError:  # (torch 2.11 under torch.autograd.grad, which leaves .grad alone)
        return None


register(OpDef(
    "BasicLinear", "linear",
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features),
          DEVICE, DTYPE, *LINEAR_PARALLEL, MAIN_GRAD),
    params=(Param("weight", lambda a: (a["out_features"], a["in_features"]), lambda a: "kaiming_uniform"),),
    fixed_in=lambda a: a["in_features"],
    out_features=lambda a, n: a["out_features"],
    reference=(linear, linear_bwd),
    reference_helpers=(accumulate_into_main_grad, add_into_main_grad, _main_grad_of, _main_grad_result, weight_grad,
                       _grad_to_add_into, _row_blocks_of, _accumulated_grad),
    summary="y = x W^T",
    needs_input_in_backward=True,
))
def _module_mode(a) -> str | None:
    """TE's te.Linear module spelling: its parallel_mode is te.ops' tensor_parallel_mode (and its
    row-parallel bias is added after the reduction: tensor_parallel.py reads the call's parallel_mode)."""
    if a["parallel_mode"] is not None and a["tensor_parallel_mode"] not in (None, a["parallel_mode"]):
        return (f"parallel_mode={a['parallel_mode']!r} (TE's module) and tensor_parallel_mode="
                f"{a['tensor_parallel_mode']!r} (TE's op) disagree; give one of them")
    return None


register(OpDef(
    "Linear", "container",
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features),
          Arg("bias", "bool", True, keyword_only=True), DEVICE, DTYPE, *LINEAR_PARALLEL, MAIN_GRAD,
          MODULE_PARALLEL_MODE, TP_SIZE),
    validate=_module_mode,
    expand=lambda a: [("BasicLinear", {"in_features": a["in_features"], "out_features": a["out_features"],
                                       "device": a["device"], "dtype": a["dtype"],
                                       **{arg.name: a[arg.name] for arg in LINEAR_PARALLEL},
                                       "tensor_parallel_mode": a["tensor_parallel_mode"] or a["parallel_mode"],
                                       "accumulate_into_main_grad": a["accumulate_into_main_grad"]}, "")]
    + ([("Bias", {"size": a["out_features"], "device": a["device"], "dtype": a["dtype"]}, "")] if a["bias"] else []),
    summary="BasicLinear followed by Bias",
))
