"""Delayed scaling's state, as TE keeps it (part of
a fusegen output's runtime: templates/runtime/, copied verbatim; do not edit).

``Fp8State`` is one holder's scales and amax histories in TE's slots, saved in the holder's
``_extra_state`` as TE saves them (Fp8SpecOp for a te.ops op; module_helpers.TeModuleOp for TE's
modules), the update after a step being fp8_autocast's ``update_states``.
"""

import io
import pickle

import torch

from .fp8_recipes import DelayedScaling, Float8CurrentScaling, Format, _FormatHelper, as_recipe
from .module_helpers import SpecOp

class Fp8State:
    """One holder's delayed-scaling state, TE's layout: per GEMM ``per_gemm[0]`` forward slots
    (input, weight[, output]) and ``per_gemm[1]`` backward slots (grad output[, grad input]):
    te.ops' BasicLinear (2, 1), TE's modules (3, 2). ``scale [slots]`` and ``amax_history [len,
    slots]`` per mode, made on the first FP8 call (on its device) and remade for a new history
    length (kept, truncated or zero-padded, as TE does)."""

    def __init__(self, gemms, per_gemm):
        self.gemms, self.per_gemm = gemms, per_gemm
        self.recipe = None
        self.modes = {}  # "forward"/"backward" -> (scale, amax_history)
        self.weights = [None] * gemms  # each GEMM's cached FP8 weight (_QuantizedWeight)

    def forget_weights(self):
        """Drops the cached FP8 weights: the parameters or the weights' scales changed (delayed
        scaling's forward update, a loaded state, another recipe)."""
        self.weights = [None] * self.gemms

    def slots(self, mode):
        return self.gemms * self.per_gemm[0 if mode == "forward" else 1]

    def prepare(self, recipe, device):
        """The state for ``recipe`` on ``device`` (delayed scaling only): made, moved or resized."""
        if self.recipe is not None and self.recipe != recipe:
            self.forget_weights()
        self.recipe = recipe
        length = recipe.amax_history_len
        for mode in ("forward", "backward"):
            # (a Quantize that casts in one mode: TE keeps no state for the other)
            if not self.slots(mode):
                continue
            have = self.modes.get(mode)
            if have is None:
                scale = torch.ones(self.slots(mode), dtype=torch.float32, device=device)
                history = torch.zeros(length, self.slots(mode), dtype=torch.float32, device=device)
            else:
                scale, history = (t if t.device == device else t.to(device) for t in have)
                if history.shape[0] != length:  # TE's adjust_amax_history_length
                    kept = history[:length]
                    history = torch.cat(
                        [kept, kept.new_zeros(length - kept.shape[0], kept.shape[1])])
            self.modes[mode] = (scale, history)

    def slot(self, mode, gemm, which):
        return gemm * self.per_gemm[0 if mode == "forward" else 1] + which

    # TE's _extra_state payload: per mode as te.ops' BasicOperation writes it (``module`` False),
    # or one dict as TE's modules do (TransformerEngineBaseModule.get_extra_state)
    def extra_state(self, module):
        if not self.modes:  # FP8 never ran (or a stateless recipe): TE's empty tensor
            return torch.empty(0, dtype=torch.uint8)
        parts = {}
        for mode, (scale, history) in self.modes.items():
            tag = _TAGS[mode]
            parts[mode] = {"recipe": self.recipe, f"scale_{tag}": scale.detach().cpu(),
                           f"amax_history_{tag}": history.detach().cpu()}
        if module:
            payload = {key: value for part in parts.values() for key, value in part.items()}
            payload["extra_fp8_variables"] = {"num_gemms": self.gemms}
        else:
            payload = {mode: {**part, "extra_fp8_variables": {}} for mode, part in parts.items()}
        buffer = io.BytesIO()
        pickle.dump(payload, buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def load_extra_state(self, state, where):
        """Reads TE's payload (either form) into this state; an empty one (FP8 never ran) is
        nothing to load."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        try:
            raw = state.detach().cpu().numpy().tobytes() if isinstance(
                state, torch.Tensor) else state.getvalue()
            payload = _TeUnpickler(io.BytesIO(raw)).load()
        except Exception as error:
            raise RuntimeError(
                f"{where}: its _extra_state is not TE's FP8 scaling state ({error})") from None
        per_mode = "forward" in payload or "backward" in payload
        for mode, tag in _TAGS.items():
            part = payload.get(mode, {}) if per_mode else payload
            if f"scale_{tag}" not in part:
                continue
            scale, history = part[f"scale_{tag}"], part[f"amax_history_{tag}"]
            if scale.numel() != self.slots(mode):
                raise RuntimeError(f"{where}: the checkpoint's FP8 state has {scale.numel()} {mode} scales, this "
                                   f"module {self.slots(mode)}: it was saved from another module")
            device = self.modes[mode][0].device if mode in self.modes else scale.device
            self.modes[mode] = (
                scale.to(device, torch.float32).clone(), history.to(device, torch.float32).clone())
            if mode == "forward":
                self.forget_weights()
            if part.get("recipe") is not None:
                self.recipe = as_recipe(part["recipe"], fresh=True)


_TAGS = {"forward": "fwd", "backward": "bwd"}


class _TeUnpickler(pickle.Unpickler):
    """Unpickles TE's payload without TE: its recipe classes (transformer_engine.common.recipe's
    DelayedScaling, Float8CurrentScaling, Format and its values) are read as this package's mirrors,
    whose fields have TE's names (a field TE has and they lack is dropped by as_recipe)."""

    def find_class(self, module, name):
        if module.startswith("transformer_engine.common.recipe"):
            mirrors = {"DelayedScaling": DelayedScaling, "Float8CurrentScaling": Float8CurrentScaling,
                       "Format": Format, "_FormatHelper": _FormatHelper}
            if name in mirrors:
                return mirrors[name]
        return super().find_class(module, name)


class Fp8SpecOp(SpecOp):
    """A te.ops op of the spec that holds an FP8 GEMM's state (``fp8``): TE's _extra_state of a
    te.ops op, per mode (BasicOperation.get_extra_state)."""

    def get_extra_state(self):
        return self.fp8.extra_state(module=False)

    def set_extra_state(self, state):
        self.fp8.load_extra_state(state, self.call)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a checkpoint saved before the pipeline was built for FP8 (or by fusegen.eager) has no
        # _extra_state here: FP8 never ran, which is what an empty one says
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "_extra_state" in missing_keys:
            missing_keys.remove(prefix + "_extra_state")


def forget_fp8_weights(module):
    """Drops ``module``'s cached FP8 weights (after changing a parameter through ``.data``, which
    the cache does not see)."""
    for child in module.modules():
        state = getattr(child, "fp8", None)
        if isinstance(state, Fp8State):
            state.forget_weights()
