"""Stage implementations: how each family of fused stages runs.

A rule (fusion_rules/) produces a stage of one of these; everything about running it lives in
its home: which op chains it can run (checked when a rule is defined), what it saves for
backward, the kernels it needs, and the calls over values it lowers the stage's forward and
backward into (emit renders them). A kernel family has a folder (elementwise/, norm/,
column_sum/, attention/ (the attention stage and its attention_prep kernels), quantize/ (the FP8
casts a GEMM stage built for FP8 launches through the runtime): its stage, its
KernelSpecs and tuning, its KernelFamily objects; templates/<family>/ mirrors it); the stages that
launch no generated kernel (gemm, opaque, module, reshape, collective) are one module each.
"""

from ..planned import Recompute, Saves
from .attention import ATTENTION, ATTENTION_PREP
from .base import Block, Emitter, StageImpl
from .collective import COLLECTIVE, COLLECTIVE_GEMM
from .elementwise import ELEMENTWISE
from .gemm import GEMM
from .norm import NORM
from .quantize import QUANTIZE
from .module import MODULE
from .opaque import OPAQUE
from .reshape import RESHAPE

__all__ = ["ATTENTION", "ATTENTION_PREP", "COLLECTIVE", "COLLECTIVE_GEMM", "ELEMENTWISE", "GEMM", "MODULE", "NORM", "OPAQUE", "QUANTIZE", "RESHAPE", "Block", "Emitter", "Recompute", "Saves", "StageImpl", "stage_kernels"]


def stage_kernels(plan) -> dict:
    """Kernels per stage that has any, keyed by (pass, stage start); the stage's main kernel first.
    The no-grad forward's stages are keyed ("inference", start): forward stages to their kernels."""
    out = {}
    for pass_, stages in (("forward", plan.forward), ("backward", plan.backward), ("inference", plan.inference)):
        for stage in stages:
            specs = stage.rule.stage.kernels(plan, stage, "backward" if pass_ == "backward" else "forward")
            if specs:
                out[(pass_, stage.start)] = specs
    return out
