"""Kernel loading and launching for a fusegen output package, and what its generated modules call
around them. Copied verbatim from fusegen's templates/runtime/; do not edit.

Needs torch, plus cuda-bindings for CUDA tensors only (imported on first launch). Its modules, by
subject, each importing only those listed above it:
- loading: a kernel's prebuilt binary for the device, sha256-checked, loaded once per process
  (KernelNotAvailableError, KernelIntegrityError);
- launch: Kernel, a launch on PyTorch's current stream (never synchronising, never allocating);
- te_forms: TE's attention modules' call forms (x's dims per qkv_format; TE's forward keywords as
  seq_lens / max_seqlen);
- checks: a generated module's run-time checks of its inputs and parameters;
- capture: a run captured into a CUDA graph on a stream of its own;
- training_graphs: a forward and backward under autograd replayed from CUDA graphs;
- module_helpers: SpecOp (TeModuleOp: a TE module's, with TE's _extra_state), inputs as rows, results in the caller's shape, first_order_only;
- row_blocks: rows_view and join_rows (TE's noop_cat: a parameter held as named row blocks joined
  for its GEMM, their grads split back by the Function, split_rows, or by autograd), adjacent_rows
  (the blocks one buffer again after a move, a cast or rows_after_load), grouped_rows (TE's interleaved QKV rows in
  the order fusegen's attention reads);
- graphs: CudaGraphs, a module's graphs per input shape;
- custom_ops: the ``fusegen::`` custom ops that torch.compile calls;
- compiled_passes: torch.compile's forward and backward ops of a graph-replaying module;
- fp8_recipes: TE's FP8 formats and recipes (and fusegen's row-wise one);
- fp8_autocast: TE's autocast, a module's call inside it (fp8_runs, fp8_eagerly), and delayed
  scaling's update after a step;
- fp8_state: delayed scaling's scales and amax histories (Fp8State, saved as TE's _extra_state;
  Fp8SpecOp) and TE's update of them after a step;
- fp8_casts: FP8 casts (the quantize kernels' CPU path: fp8_reference_amax, fp8_reference_cast,
  fp8_reference_delayed_update, the row-wise recipe's fp8_reference_cast_rows,
  block scaling's fp8_reference_cast_blocks,
  fp8_reference_amax_cols, fp8_reference_cast_cols; a producer's FP8 variant's,
  fp8_reference_produced) and GEMMs (scaled_mm: torch._scaled_mm, or emulated);
- fp8: a call's FP8 GEMMs (fp8_call, Fp8Call): the recipe's casts, the GEMMs, the weight cache.
- collectives: tensor parallelism's collectives (autograd Functions; micro-pipelined with GEMMs),
  and tensor_parallel: a module's group (its check; a size of several built) and its shards'
  state_dict helpers (both imported by the generated modules built for a tensor-parallel size, as
  modules).
Here: the names the generated modules (and the package's users) import from ``_runtime``.
"""

from . import collectives, tensor_parallel
from .checks import (check_input, check_packed_form, check_parameters, check_row_input,
                     packed_sequences)
from .te_forms import te_sequences
from .compiled_passes import PassGraphs, keep_for_backward, register_training_ops
from .fp8 import fp8_call
from .fp8_casts import (fp8_reference_amax, fp8_reference_amax_cols, fp8_reference_cast, fp8_reference_cast_blocks,
                        fp8_reference_cast_cols, fp8_reference_cast_rows, fp8_reference_delayed_update,
                        fp8_reference_produced)
from .fp8_autocast import autocast, fp8_autocast, fp8_eagerly, fp8_runs
from .fp8_recipes import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling, Format,
                          MMParams, QParams)
from .fp8_state import Fp8SpecOp, Fp8State, forget_fp8_weights
from .custom_ops import register_no_grad_op, register_op
from .graphs import CudaGraphs
from .launch import Kernel, pointer
from .loading import KernelIntegrityError, KernelNotAvailableError
from .module_helpers import SpecOp, TeModuleOp, as_rows, first_order_only, with_lead, with_shape
from .row_blocks import adjacent_rows, grouped_rows, join_rows, rows_after_load, rows_view, split_rows
from .training_graphs import backward_done, replay_backward, replay_forward, saved_tensors

__all__ = [
    "CudaGraphs", "DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "Float8RowwiseScaling", "Format",
    "Fp8SpecOp", "Fp8State", "Kernel", "KernelIntegrityError", "KernelNotAvailableError", "MMParams", "PassGraphs",
    "QParams", "SpecOp", "TeModuleOp", "adjacent_rows", "as_rows", "autocast", "backward_done", "check_input", "check_packed_form",
    "check_parameters", "check_row_input", "collectives", "first_order_only", "forget_fp8_weights", "fp8_autocast", "fp8_call",
    "fp8_eagerly", "fp8_runs",
    "fp8_reference_amax", "fp8_reference_amax_cols", "fp8_reference_cast", "fp8_reference_cast_blocks",
    "fp8_reference_cast_cols", "fp8_reference_cast_rows", "fp8_reference_delayed_update", "fp8_reference_produced",
    "grouped_rows", "join_rows",
    "keep_for_backward", "packed_sequences", "pointer", "register_no_grad_op", "register_op",
    "register_training_ops", "replay_backward", "replay_forward", "rows_after_load", "rows_view",
    "saved_tensors", "split_rows", "te_sequences", "tensor_parallel", "with_lead", "with_shape",
]
