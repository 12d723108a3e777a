"""The norm kernel family: LayerNorm / RMSNorm / L2Normalization as a generated row kernel."""

from . import family  # noqa: F401 - registers the norm kernel families (KernelFamily)
from .stage import NORM

__all__ = ["NORM"]
