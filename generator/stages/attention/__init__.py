"""The attention stage and its kernel family, attention_prep: a self-attention op runs as
FlashAttention-2 (PyTorch's varlen kernels) with a generated prep kernel on each side of it
(stage.py: the lowering; kernels.py: the prep kernels' specs; family.py: how they launch)."""

from .family import ATTENTION_PREP
from .kernels import prep_backward, prep_forward
from .stage import ATTENTION

__all__ = ["ATTENTION", "ATTENTION_PREP", "prep_backward", "prep_forward"]
