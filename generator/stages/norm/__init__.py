"""The norm kernel family: LayerNorm / RMSNorm / L2Normalization as a generated row kernel."""

from .stage import NORM

__all__ = ["NORM"]
