"""FP8 recipes as Transformer Engine defines them (part of a fusegen output's runtime:
templates/runtime/, copied verbatim; do not edit).

- ``Format`` and the recipes, mirrors of TE's (``transformer_engine.common.recipe``: the same
  names, fields and defaults; TE's own recipe objects are accepted too, so a package never needs
  TE): ``DelayedScaling`` (a scale per tensor from an amax history, updated after each step),
  ``Float8CurrentScaling`` (a scale per tensor from its own amax), ``Float8BlockScaling`` (a scale
  per 1x128 or 128x128 block, with its ``QParams``) and ``Float8RowwiseScaling`` (fusegen's: a
  scale per row of each GEMM operand, torchao's "rowwise");
- ``as_recipe`` (TE's recipe objects read as these), ``recipe_kind``, ``default_recipe``, and each
  recipe's FP8 dtypes and largest values (``fp8_dtype``, ``fp8_max``), a cast's scale options
  (``scale_options``, ``ScaleOptions``) and a GEMM's accumulation (``fast_accumulation``); autocast, which chooses a
  recipe, is fp8_autocast's.

The rules and the TE sources they come from: docs/fp8_te_semantics.md in fusegen's repository.
"""

import dataclasses
import enum
import os
import struct
import typing

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
class QParams:
    """TE's QParams: a tensor role's scale options, ``power_2_scale`` (the scale floored to a power
    of 2) and ``amax_epsilon`` (a floor under the amax)."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0


@dataclasses.dataclass
class MMParams:
    """TE's MMParams: a GEMM's ``use_split_accumulator`` (False: FP8 fast accumulation, cuBLAS's
    FAST_ACCUM)."""

    use_split_accumulator: bool = True


_OVERRIDES = (None, "high_precision", "dequantized")  # TE's _BACKWARD_OVERRIDES


def _check_backward_override(recipe, allowed=_OVERRIDES):
    if recipe.backward_override not in allowed:
        raise ValueError(f"{type(recipe).__name__}(backward_override={recipe.backward_override!r}): give "
                         f"{' or '.join(repr(v) for v in allowed)} (TE's rule; NVTE_BACKWARD_OVERRIDE sets the default)")


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
    backward_override: object = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self):
        _check_format(self)
        _check_backward_override(self, (None,))  # "Delayed scaling only supports backward_override=None."
        if self.amax_compute_algo not in ("max", "most_recent") and not callable(self.amax_compute_algo):
            raise ValueError(f"DelayedScaling(amax_compute_algo={self.amax_compute_algo!r}): give 'max', "
                             "'most_recent' or a function of the amax history")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling(amax_history_len={self.amax_history_len!r}): give an int >= 1")


@dataclasses.dataclass
class Float8CurrentScaling:
    """TE's Float8CurrentScaling: each tensor cast with ``fp8_max / amax`` of itself (stateless).
    As in TE, a Linear casts its input, weight and output grad with its role's QParams (class
    attributes made once, from NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES; ``use_power_2_scales``
    given later does not reach them: TE's modules read the QParams), a spec's Quantize with
    ``use_power_2_scales``; each GEMM accumulates as its MMParams say; ``backward_override``
    "high_precision" runs the backward's GEMMs in high precision on the forward's high-precision
    operands, "dequantized" on its FP8 operands dequantized (the output grad not cast in either)."""

    use_power_2_scales: bool = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp = QParams(power_2_scale=use_power_2_scales)
    fp8_quant_fwd_weight = QParams(power_2_scale=use_power_2_scales)
    fp8_quant_bwd_grad = QParams(power_2_scale=use_power_2_scales)
    fp8_gemm_fprop: MMParams = dataclasses.field(default_factory=lambda: MMParams(use_split_accumulator=False))
    fp8_gemm_dgrad: MMParams = dataclasses.field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = dataclasses.field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: object = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self):
        _check_format(self)
        _own_qparams(self)
        _check_backward_override(self)


@dataclasses.dataclass
class Float8RowwiseScaling:
    """fusegen's row-wise recipe (torchao's "rowwise"; TE has none for Hopper): each GEMM operand
    cast with a scale per row along the GEMM's reduction dim, ``fp8_max / max(amax, 1e-12)``
    rounded down to a power of 2; E4M3 for the grads too."""

    fp8_format: Format = Format.E4M3
    use_power_2_scales: bool = True

    def __post_init__(self):
        _check_format(self)


@dataclasses.dataclass
class Float8BlockScaling:
    """TE's Float8BlockScaling: each GEMM operand cast with TE's scale per block, 1x128 (128 values
    along the GEMM's reduction dim: x and the grads) or 128x128 (the weights); power-of-2 scales
    unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 when the class is made (TE's rule); every GEMM
    with split accumulation (TE asserts it). ``torch._scaled_mm`` takes 128x128 blocks for a
    GEMM's second operand only, so x and the grads are cast in 1x128 blocks (TE's defaults).
    ``backward_override`` as Float8CurrentScaling's."""

    use_f32_scales: bool = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp = QParams(power_2_scale=not use_f32_scales)
    fp8_quant_fwd_weight = QParams(power_2_scale=not use_f32_scales)
    fp8_quant_bwd_grad = QParams(power_2_scale=not use_f32_scales)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = dataclasses.field(default_factory=MMParams)
    fp8_gemm_dgrad: MMParams = dataclasses.field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = dataclasses.field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: object = os.getenv("NVTE_BACKWARD_OVERRIDE", None)

    def __post_init__(self):
        _check_format(self)
        for role in ("x", "w", "grad"):
            if getattr(self, f"{role}_block_scaling_dim") not in (1, 2):
                raise ValueError(f"Float8BlockScaling({role}_block_scaling_dim="
                                 f"{getattr(self, f'{role}_block_scaling_dim')!r}): give 1 (1x128 blocks) or 2 (128x128)")
        if self.x_block_scaling_dim == 2 or self.grad_block_scaling_dim == 2:
            raise ValueError("Float8BlockScaling(x_block_scaling_dim=2 or grad_block_scaling_dim=2): torch._scaled_mm "
                             "takes 128x128 blocks for a GEMM's second operand only (the weight), so this package "
                             "casts x and the grads in 1x128 blocks, TE's defaults; give 1")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("Float8BlockScaling(fp8_dpa/fp8_mha=True): FP8 attention is not supported for "
                             "Float8BlockScaling (TE's rule)")
        for gemm in ("fprop", "dgrad", "wgrad"):
            if not getattr(self, f"fp8_gemm_{gemm}").use_split_accumulator:
                raise ValueError(f"Float8BlockScaling(fp8_gemm_{gemm}=MMParams(use_split_accumulator=False)): block "
                                 "scaling needs split accumulation in every GEMM (TE's rule)")
        _own_qparams(self)
        _check_backward_override(self)


RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "rowwise": Float8RowwiseScaling,
           "block": Float8BlockScaling}
_ROLES = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")  # a recipe's QParams, by role
_KIND = {cls: kind for kind, cls in RECIPES.items()}


def _own_qparams(recipe):
    """The recipe's own copies of its class's QParams (shared objects in TE: changing one recipe's
    would change every one's)."""
    for role in _ROLES:
        setattr(recipe, role, dataclasses.replace(getattr(recipe, role)))


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
        raise TypeError(f"autocast(recipe={recipe!r}): this package runs DelayedScaling, Float8CurrentScaling, "
                        "Float8BlockScaling and Float8RowwiseScaling (TE's, or the package's own: from <package> "
                        "import DelayedScaling); TE's MXFP8BlockScaling and NVFP4BlockScaling are not supported")
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(mirror) if hasattr(recipe, f.name)}
    fields["fp8_format"] = _format_of(fields.get("fp8_format", Format.HYBRID), mirror.__name__)
    for name, value in fields.items():  # TE's MMParams objects, read by attribute
        if name.startswith("fp8_gemm_"):
            fields[name] = MMParams(bool(value.use_split_accumulator))
    made = mirror(**fields)
    for role in _ROLES if hasattr(mirror, _ROLES[0]) else ():  # QParams: class attributes in TE, no fields
        given = getattr(recipe, role, getattr(made, role))
        setattr(made, role, QParams(bool(given.power_2_scale), float(given.amax_epsilon)))
    return made


def recipe_kind(recipe) -> str:
    """"delayed", "current", "rowwise" or "block": the name ``[tool.fusegen] fp8`` builds a recipe
    under."""
    return _KIND[type(recipe)]


def default_recipe(device=None):
    """TE's get_default_fp8_recipe for the recipes this package runs: DelayedScaling on GPUs before
    compute capability 12.0 (Hopper), Float8CurrentScaling from it on (TE prefers MXFP8 on
    Blackwell, which fusegen does not run)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (12, 0):
        return Float8CurrentScaling()
    return DelayedScaling()


def fp8_dtype(recipe, forward):
    """TE's get_fp8_torch_dtype: E4M3, or E5M2 for the backward's tensors under HYBRID."""
    if recipe.fp8_format is Format.E4M3 or (recipe.fp8_format is Format.HYBRID and forward):
        return torch.float8_e4m3fn
    return torch.float8_e5m2


def fp8_max(recipe, forward):
    return recipe.fp8_format.value.max_fwd if forward else recipe.fp8_format.value.max_bwd


def float_bits(value):
    """A float's fp32 bits as an int (how a cast kernel takes an amax epsilon)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def scale_options(recipe, role):
    """(the amax epsilon's fp32 bits, power_2) of a cast of ``role``: "x", "w" or "grad", a Linear's
    operand, with the recipe's QParams for it (TE's modules copy them onto their quantizers; te.ops
    misspells the epsilon's attribute, so TE's te.ops ignore it: here every Linear honours it);
    "quantize", a spec Quantize's, with the recipe's use_power_2_scales and no epsilon (TE's
    recipe-state quantizer). A recipe without QParams (fusegen's row-wise) has use_power_2_scales
    alone."""
    if role == "quantize" or not hasattr(recipe, _ROLES[0]):
        return 0, int(getattr(recipe, "use_power_2_scales", False))
    params = getattr(recipe, _ROLES[("x", "w", "grad").index(role)])
    return float_bits(params.amax_epsilon), int(params.power_2_scale)


class ScaleOptions(dict):
    """A recipe's scale_options by role, each found when a call first casts in that role."""

    def __init__(self, recipe):
        super().__init__()
        self.recipe = recipe

    def __missing__(self, role):
        self[role] = found = scale_options(self.recipe, role)
        return found


def fast_accumulation(recipe):
    """{"fprop", "dgrad", "wgrad": whether that GEMM of a Linear accumulates fast}
    (torch._scaled_mm's use_fast_accum, TE's use_split_accumulator off): the recipe's MMParams
    where it has them, else TE's module constants (_2X_ACC_FPROP False, _2X_ACC_DGRAD and
    _2X_ACC_WGRAD True: the forward alone fast)."""
    return {gemm: not getattr(recipe, f"fp8_gemm_{gemm}", MMParams(gemm != "fprop")).use_split_accumulator
            for gemm in ("fprop", "dgrad", "wgrad")}
