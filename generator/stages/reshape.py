"""Reshape stages: TE's Reshape on the 2-D [rows, features] tensors the fused stages work on.

Forward: the running tensor viewed as [-1, shape[-1]] (torch.reshape: a view when the memory
allows, as TE's); backward: the grad viewed back as [-1, input features]. No kernel. The leading
dims the reshape makes are the generated module's business (its outputs take them: emit/pipeline.py).
An input size no op fixes is ``em.width`` (``n``), the width the forward saw (a size-generic
pipeline). A -1 last dim no op after it fixes is known at run time: the forward views the tensor
as the rows its leading dims make, torch inferring the width.
"""

from __future__ import annotations

import math
from fractions import Fraction

from ..ir import Sym, size_expr
from ..calls import TorchCall
from .base import NO_TRAFFIC, StageImpl, fixed


class ReshapeStage(StageImpl):
    name = "reshape"
    launches = False

    def check(self, pass_, chain):
        return None if list(chain) == ["reshape"] else "a reshape stage runs one Reshape"

    def runs_as(self, pass_, stage, kernels):
        return "a view (`torch.reshape`), no kernel"

    def row_traffic(self, plan, pass_, stage):
        return NO_TRAFFIC  # a view of a dense tensor

    def rows_factor(self, stage):
        op = stage.ops[0]  # [rows, in] viewed as [rows * in / out, out]
        return Fraction(op.in_features, op.out_features) if fixed(op.in_features, op.out_features) else None

    def forward(self, em, stage, block):
        op = stage.ops[0]
        if isinstance(op.out_features, Sym) and not op.out_features.of_input:  # a -1 last dim known at run time
            rows = math.prod(op.opdef.reshape(op.args)[:-1])  # the leading dims, all given
            text = f"{{y}} = {{x}}.reshape({rows}, -1)"
        else:  # a last dim the spec gives (ir.py: a Reshape's output width is given or known at run time)
            assert isinstance(op.out_features, int), f"{op.describe()}: output width {op.out_features}"
            text = f"{{y}} = {{x}}.reshape(-1, {op.out_features})"
        block.add(TorchCall(text, dict(x=stage.input), dict(y=stage.output)))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        op = stage.ops[0]
        # the input width a size-generic pipeline's backward reads: a value (em.width's name)
        width = {"n": em.pipeline.input_width} if isinstance(op.in_features, Sym) and op.in_features.of_input else {}
        block.add(TorchCall(f"{{dx}} = {{dy}}.reshape(-1, {size_expr(op.in_features, '{n}', '//')})",
                            dict(width, dy=dy), dict(dx=d_in)))
        em.shares_memory(d_in, dy)  # a view
        return d_in


RESHAPE = ReshapeStage()
