"""A module that is imported on first use, so op modules can name ``torch`` at the top.

The compiler imports every op module (it reads their ``OpDef``s) and must run without torch
(planning, emitting and ``--check`` need only libcst, jinja2 and NVRTC). Op modules write
``from .lazy import torch`` instead of ``import torch``: the name exists at import time, and the
real module is imported the first time a reference function reads an attribute of it. The shipped
``_reference.py`` has a plain ``import torch`` instead (ops.shipped writes its header).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    """Stands for the module ``name``; any attribute read imports it (once) and reads it there."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):  # only called for names not set in __init__
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<lazy module {self._name!r} ({state})>"


torch = LazyModule("torch")
