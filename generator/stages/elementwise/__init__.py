"""The elementwise kernel family: runs of elementwise ops as one generated kernel a pass."""

from . import family  # noqa: F401 - registers the elementwise kernel families (KernelFamily)
from .stage import ELEMENTWISE

__all__ = ["ELEMENTWISE"]
