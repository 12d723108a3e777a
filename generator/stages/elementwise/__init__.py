"""The elementwise kernel family: runs of elementwise ops as one generated kernel a pass."""

from .stage import ELEMENTWISE

__all__ = ["ELEMENTWISE"]
