"""The column_sum kernel family: a backward's fp32 per-block partials summed over the blocks, in
a fixed order, into one grad a column (the second launch of a norm or elementwise backward that
does not add its grads itself)."""

from .kernel import COLUMN_SUM, column_sum

__all__ = ["COLUMN_SUM", "column_sum"]
