"""Emit: plans → the files of the output package (Python modules and CUDA sources).

Each stage's implementation lowers it into typed calls over values (stages/, calls.py); emit
renders them, one block per stage headed by a comment naming the rule that made the stage, and
jinja templates lay the files out. Every name is derived from the spec (``linear1_weight``,
``d_layernorm0_out``), so a change to a spec or a rule shows up as a readable diff.

- ``blocks``: the forward, backward and no-grad blocks; what the forward saves (from the
  backward calls' reads); each returned grad in memory of its own
- ``convention``: the calling convention, from the roles of the pipeline's free values
- ``segments``: the autograd Functions around user modules
- ``plan_doc``: plan.md's tables, traffic and diagrams
- ``pipeline``: the context of pipeline.py.j2 and plan.md.j2
- here: the templates' environment
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jinja2

from .. import source_text
from ..ir import size_expr
from ..kernels import plugin_template
from .held import child_module
from .blocks import backward_blocks, forward_blocks, own_memory, saved_for_backward
from .pipeline import leading_dims, pipeline_context, replays_graphs
from .plan_doc import traffic_cells
from .segments import segments

__all__ = ["TEMPLATES", "backward_blocks", "environment", "forward_blocks", "leading_dims", "own_memory",
           "pipeline_context", "replays_graphs", "saved_for_backward", "segments", "traffic_cells"]


def _templates_dir() -> Path:
    """templates/ as installed: the folder fusegen.templates maps to (beside generator/ in a
    checkout installed in editable mode, fusegen/templates in a wheel)."""
    spec = importlib.util.find_spec(f"{__package__.rpartition('.')[0]}.templates")
    return Path(next(iter(spec.submodule_search_locations)))


TEMPLATES = _templates_dir()


@functools.cache
def environment() -> jinja2.Environment:
    """The templates' environment, one a process: it keeps each template compiled (jinja2 reloads
    one whose file changed), so a second build in the same process (a library user's, a test's)
    does not parse and compile every template again (two thirds of the builds' time in a profiled
    test run)."""
    env = jinja2.Environment(
        # fusegen's templates, then a build's plugins' kernel-family folders (kernels.plugin_template)
        loader=jinja2.ChoiceLoader([jinja2.FileSystemLoader(str(TEMPLATES)), jinja2.FunctionLoader(plugin_template)]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True, trim_blocks=False, lstrip_blocks=False,
    )
    # A size (ir.Size: an int, or a Sym of a size-generic pipeline) as an expression in the
    # kernel's N (CUDA) or the launcher's n (Python).
    env.filters["cexpr"] = lambda size: size_expr(size, "N", "/")
    env.filters["pyexpr"] = lambda size: size_expr(size, "n", "//")
    # a spec's own text (a user module's call, a file name) where it lands (source_text.py)
    env.filters["module"] = child_module
    env.filters["pystr"] = source_text.py_string
    env.filters["comment"] = source_text.comment_text
    env.filters["docstring"] = source_text.docstring_text
    env.filters["mdcode"] = source_text.md_code
    return env
