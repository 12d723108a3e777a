"""FP8 recipes as Transformer Engine defines them, and the autocast that chooses one (part of a
fusegen output's runtime: templates/runtime/, copied verbatim; do not edit).

- ``Format`` and the recipes, mirrors of TE's (``transformer_engine.common.recipe``: the same
  names, fields and defaults; TE's own recipe objects are accepted too, so a package never needs
  TE): ``DelayedScaling`` (a scale per tensor from an amax history, updated after each step),
  ``Float8CurrentScaling`` (a scale per tensor from its own amax) and ``Float8RowwiseScaling``
  (fusegen's: a scale per row of each GEMM operand, torchao's "rowwise");
- ``autocast`` (TE's ``te.autocast``; ``fp8_autocast`` its deprecated spelling): the modules built
  for FP8 called inside it run their GEMMs in FP8 under its recipe, outside it in high precision;
- ``update_states``: delayed scaling's update after a step (TE's reduce_and_update_fp8_tensors),
  ``delayed_update`` one state's (the quantize family's fp8_delayed_update, or TE's unfused path).

The rules and the TE sources they come from: docs/fp8_te_semantics.md in fusegen's repository.
"""

import dataclasses
import enum
import threading
import typing
import warnings

import torch

FLT_MAX = torch.finfo(torch.float32).max
_EPS_ROWWISE = 1e-12  # torchao's floor on a row's amax (float8_utils.EPS)


class _FormatHelper(typing.NamedTuple):
    """A format's largest value forward and backward: a named tuple, as TE's (an enum member
    unpickles by its value, TE's as well as this package's)."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """TE's FP8 formats: E4M3 (max 448), E5M2 (max 57344), HYBRID (E4M3 forward, E5M2 grads)."""

    E4M3 = _FormatHelper(448.0, 448.0)
    E5M2 = _FormatHelper(57344.0, 57344.0)
    HYBRID = _FormatHelper(448.0, 57344.0)


@dataclasses.dataclass
class DelayedScaling:
    """TE's DelayedScaling: each tensor cast with a scale computed after the step from the max of
    its amax history, ``(fp8_max / amax) / 2**margin``."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: object = "max"  # "max", "most_recent", or f(amax_history) -> amax
    scaling_factor_compute_algo: object = None  # None, or f(amax, scale, fp8_max, recipe) -> scale
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self)
        if self.amax_compute_algo not in ("max", "most_recent") and not callable(self.amax_compute_algo):
            raise ValueError(f"DelayedScaling(amax_compute_algo={self.amax_compute_algo!r}): give 'max', "
                             "'most_recent' or a function of the amax history")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling(amax_history_len={self.amax_history_len!r}): give an int >= 1")


@dataclasses.dataclass
class Float8CurrentScaling:
    """TE's Float8CurrentScaling: each tensor cast with ``fp8_max / amax`` of itself (stateless)."""

    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    amax_epsilon = 0.0  # TE's QParams.amax_epsilon, the same for input, weight and grad

    def __post_init__(self):
        _check_format(self)


@dataclasses.dataclass
class Float8RowwiseScaling:
    """fusegen's row-wise recipe (torchao's "rowwise"; TE has none for Hopper): each GEMM operand
    cast with a scale per row along the GEMM's reduction dim, ``fp8_max / max(amax, 1e-12)``
    rounded down to a power of 2; E4M3 for the grads too."""

    fp8_format: Format = Format.E4M3
    use_power_2_scales: bool = True

    def __post_init__(self):
        _check_format(self)


RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "rowwise": Float8RowwiseScaling}
_KIND = {cls: kind for kind, cls in RECIPES.items()}


def _check_format(recipe):
    if not isinstance(recipe.fp8_format, Format):
        recipe.fp8_format = _format_of(recipe.fp8_format, type(recipe).__name__)
    if recipe.fp8_format is Format.E5M2:
        raise ValueError(f"{type(recipe).__name__}(fp8_format=Format.E5M2): pure E5M2 training is not supported "
                         "(TE's rule); use Format.HYBRID or Format.E4M3")


def _format_of(value, where):
    name = getattr(value, "name", value)
    if name not in Format.__members__:
        raise ValueError(f"{where}(fp8_format={value!r}): give Format.HYBRID, Format.E4M3 or Format.E5M2")
    return Format[name]


def as_recipe(recipe, fresh=False):
    """``recipe`` as one of this module's classes: itself (``fresh``: made anew from its fields, as
    for one unpickled from TE's payload), or TE's object of the same name
    (``transformer_engine.common.recipe``), its fields read by name."""
    if type(recipe) in _KIND and not fresh:
        return recipe
    mirror = {cls.__name__: cls for cls in RECIPES.values()}.get(type(recipe).__name__)
    if mirror is None:
        raise TypeError(f"autocast(recipe={recipe!r}): this package runs DelayedScaling, Float8CurrentScaling and "
                        "Float8RowwiseScaling (TE's, or the package's own: from <package> import DelayedScaling); "
                        "TE's MXFP8BlockScaling, Float8BlockScaling and NVFP4BlockScaling are not supported")
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(mirror) if hasattr(recipe, f.name)}
    fields["fp8_format"] = _format_of(fields.get("fp8_format", Format.HYBRID), mirror.__name__)
    made = mirror(**fields)
    epsilon = getattr(getattr(recipe, "fp8_quant_fwd_inp", None), "amax_epsilon", 0.0)
    if epsilon:
        made.amax_epsilon = epsilon
    return made


def recipe_kind(recipe) -> str:
    """"delayed", "current" or "rowwise": the name ``[tool.fusegen] fp8`` builds a recipe under."""
    return _KIND[type(recipe)]


def default_recipe(device=None):
    """TE's get_default_fp8_recipe for the recipes this package runs: DelayedScaling on GPUs before
    compute capability 12.0 (Hopper), Float8CurrentScaling from it on (TE prefers MXFP8 on
    Blackwell, which fusegen does not run)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (12, 0):
        return Float8CurrentScaling()
    return DelayedScaling()


# --- autocast --------------------------------------------------------------------------------------

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

    def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
        self.enabled, self.calibrating, self.group = bool(enabled), bool(calibrating), amax_reduction_group
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
        if not _FRAMES.stack and torch.is_grad_enabled():  # the outermost: the forward slots' update
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


# --- delayed scaling's update after a step ----------------------------------------------------------

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
            if mode == "forward":  # the weights' scales may have changed: TE casts them again a step
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
    scaled_max = torch.tensor(max_value, dtype=torch.float32) * torch.tensor(2.0**-recipe.margin)  # fp32, as TE's host
    casts.fp8_delayed_update(history, scale, amax, int(recipe.amax_compute_algo == "most_recent"),
                             int(scaled_max.view(torch.int32)))


def fp8_dtype(recipe, forward):
    """TE's get_fp8_torch_dtype: E4M3, or E5M2 for the backward's tensors under HYBRID."""
    if recipe.fp8_format is Format.E4M3 or (recipe.fp8_format is Format.HYBRID and forward):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


def fp8_max(recipe, forward):
    return recipe.fp8_format.value.max_fwd if forward else recipe.fp8_format.value.max_bwd
