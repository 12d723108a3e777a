"""TE's autocast and delayed scaling's update after a step (part of a fusegen output's runtime:
templates/runtime/, copied verbatim; do not edit).

- ``autocast`` (TE's ``te.autocast``; ``fp8_autocast`` its deprecated spelling): the modules built
  for FP8 called inside it run their GEMMs in FP8 under its recipe (fp8_recipes'), outside it in
  high precision; ``active``: the innermost one that quantizes or calibrates;
- ``fp8_runs``: whether a module's call runs in FP8; ``fp8_eagerly``: such a call, under
  torch.compile outside the graph;
- ``update_states``: delayed scaling's update after a step (TE's reduce_and_update_fp8_tensors),
  ``delayed_update`` one state's (the quantize family's fp8_delayed_update, or TE's unfused path).

The rules and the TE sources they come from: docs/fp8_te_semantics.md in fusegen's repository.
"""

import threading
import warnings

import torch

from .fp8_recipes import FLT_MAX, as_recipe, default_recipe, fp8_max


# --- autocast
# --------------------------------------------------------------------------------------

class _Frames(threading.local):
    def __init__(self):
        self.stack = []  # the open autocasts, innermost last


_FRAMES = _Frames()


class _Step:
    """What one outermost autocast gathers: the delayed-scaling states its modules cast with, whose
    forward slots are updated when it exits and backward slots after the backward of the first
    module called in it (TE's reduce_and_update_fp8_tensors and is_first_fp8_module)."""

    def __init__(self):
        self.forward = {}  # id -> (state, recipe, group)
        self.backward = {}
        self.first_taken = False


class autocast:
    """TE's ``te.autocast``: the modules of this package called inside run their GEMMs in FP8
    under ``recipe`` (default: TE's default for the GPU); ``enabled=False`` turns FP8 off inside;
    ``calibrating=True`` runs in high precision but records the amaxes delayed scaling scales
    from; ``amax_reduction_group``: the process group over which delayed scaling's amaxes are
    reduced (max) before each update (None: the default group, where torch.distributed is
    initialised). Call each module once per autocast: its amaxes are one step's."""

    def __init__(
            self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None,
            _graph=False):
        self.enabled, self.calibrating, self.group = bool(enabled), bool(
            calibrating), amax_reduction_group
        self.recipe = None if recipe is None else as_recipe(recipe)
        self.step = None

    def __enter__(self):
        if self.recipe is None and (self.enabled or self.calibrating):
            self.recipe = default_recipe()
        outer = _FRAMES.stack[0].step if _FRAMES.stack else None
        self.step = outer if outer is not None else _Step()
        _FRAMES.stack.append(self)
        return self

    def __exit__(self, *exc):
        _FRAMES.stack.pop()
        # the outermost: the forward slots' update
        if not _FRAMES.stack and torch.is_grad_enabled():
            update_states(self.step.forward.values())
        return False


def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    """TE's deprecated spelling of ``autocast``."""
    warnings.warn("fp8_autocast is deprecated, as in TE: use autocast(recipe=..., amax_reduction_group=...)",
                  DeprecationWarning, stacklevel=2)
    return autocast(enabled, calibrating, fp8_recipe, fp8_group)


def active():
    """The innermost open autocast that quantizes or calibrates, or None."""
    if not _FRAMES.stack:
        return None
    frame = _FRAMES.stack[-1]
    return frame if frame.enabled or frame.calibrating else None


# --- delayed scaling's update after a step
# ----------------------------------------------------------

def update_states(entries):
    """Delayed scaling's update after a step (TE's reduce_and_update_fp8_tensors): each group's
    amaxes (the histories' first rows) reduced with max over its process group where the recipe
    says so, then each state's scales and histories updated (``entries``: (state, mode, recipe,
    group, the package's quantize launchers))."""
    entries = list(entries)
    if not entries:
        return
    by_group = {}
    for state, mode, recipe, group, casts in entries:
        by_group.setdefault(id(group), (group, []))[1].append((state, mode, recipe, casts))
    for group, members in by_group.values():
        amaxes = [None] * len(members)  # None: the history's first row, as it is
        if any(recipe.reduce_amax for _, _, recipe, _ in members) and _distributed(group):
            rows = [state.modes[mode][1][0] for state, mode, _, _ in members]
            joined = torch.cat(rows)
            torch.distributed.all_reduce(joined, op=torch.distributed.ReduceOp.MAX, group=group)
            amaxes = list(joined.split([row.numel() for row in rows]))
        for (state, mode, recipe, casts), amax in zip(members, amaxes):
            scale, history = state.modes[mode]
            delayed_update(history, scale, amax, recipe, fp8_max(recipe, mode == "forward"), casts)
            # the weights' scales may have changed: TE casts them again a step
            if mode == "forward":
                state.forget_weights()


def _distributed(group):
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group) > 1)


def delayed_update(history, scale, amax, recipe, max_value, casts):
    """TE's amax-and-scale update after a step, in place: its fused kernel (the quantize family's
    fp8_delayed_update, ``casts``; fp8_casts.fp8_reference_delayed_update off the GPU) with the
    recipe's amax_compute_algo and ``max_value * 2**-margin`` in fp32, or, where the recipe gives
    amax_compute_algo or scaling_factor_compute_algo as a function, TE's unfused path, which always
    rolls. ``amax``: the step's reduced amax, or None (the history's first row)."""
    if callable(recipe.amax_compute_algo) or callable(recipe.scaling_factor_compute_algo):
        if amax is not None:
            history[0] = amax
        if callable(recipe.amax_compute_algo):
            chosen = recipe.amax_compute_algo(history)
        else:
            chosen = history.amax(0) if recipe.amax_compute_algo == "max" else history[0].clone()
        if history.shape[0] > 1:
            history.copy_(torch.roll(history, -1, 0))
        history[0] = 0
        if callable(recipe.scaling_factor_compute_algo):
            new = recipe.scaling_factor_compute_algo(chosen, scale, max_value, recipe)
        else:
            new = (max_value / chosen) / (2 ** recipe.margin)
            new = torch.where(chosen > 0.0, new, scale)
            new = torch.where(torch.isfinite(chosen), new, scale)
            new = torch.where(torch.isinf(new), torch.full_like(new, FLT_MAX), new)
        scale.copy_(new)
        return
    # fp32, as TE's host
    scaled_max = torch.tensor(max_value, dtype=torch.float32) * torch.tensor(2.0**-recipe.margin)
    casts.fp8_delayed_update(history, scale, amax, int(recipe.amax_compute_algo == "most_recent"),
                             int(scaled_max.view(torch.int32)))


# --- a module's call inside autocast -------------------------------------------------------------

def fp8_runs(module, x):
    """Whether a call of ``module`` on ``x`` (its [rows, features] input) runs in FP8: inside an
    autocast that quantizes or calibrates, on at least ``module.fp8_min_rows`` rows (fewer run in
    high precision, where FP8 GEMMs do not pay; delayed scaling then records no amax). Outside
    autocast a call costs the module this check. torch.compile's trace reads it too: a compiled
    module is guarded on the autocast stack, traced again when it runs inside autocast."""
    frame = active()
    return frame is not None and x.shape[0] >= module.fp8_min_rows


def _run(forward, *args):
    return forward(*args)


# _run behind torch.compiler.disable, made when first needed (importing dynamo takes 0.7 s)
_EAGER = []
EAGER_REASON = ("an FP8 call of a fusegen module (inside its package's autocast) runs outside torch.compile's "
                "graph, as each of TE's modules does: compile without fullgraph=True, or call it outside autocast")


def fp8_eagerly(forward, *args):
    """``forward(*args)``: a module's call with FP8 GEMMs. Under torch.compile it runs outside the
    graph, by Python (a graph break, as each of TE's modules is under torch.compile): its Fp8Call,
    the recipe's state updates and the FP8 weight cache are Python objects a graph cannot hold,
    and the FP8 stages launch the package's kernels as they do eagerly. fullgraph=True refuses it
    with EAGER_REASON."""
    if not torch.compiler.is_compiling():
        return forward(*args)
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_run, reason=EAGER_REASON))
    return _EAGER[0](forward, *args)
