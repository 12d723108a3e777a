"""Emit: plans → the files of the output package (Python modules and CUDA sources).

For the move of emit.py into this package: everything it held is still here (``emit.environment``,
``emit.pipeline_context``, ...)."""

from .pipeline import *  # noqa: F401,F403
from .pipeline import (TEMPLATES, backward_blocks, environment, forward_blocks, leading_dims, own_memory,  # noqa: F401
                       pipeline_context, replays_graphs, saved_for_backward, segments, traffic_cells)
