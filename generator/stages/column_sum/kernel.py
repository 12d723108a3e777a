"""The column sum's spec and its family: templates/column_sum/ (its .cu.j2 and launcher) and
templates/cuda/column_sum.cuh (its math, shared with the backwards that sum their own grads)."""

from __future__ import annotations

from ...kernels import KernelFamily, KernelParam, KernelSpec, kernel_name, make_spec, register_family


def column_sum(columns: int) -> KernelSpec:
    P = KernelParam
    return make_spec(kernel_name("column_sum", f"n{columns}"), "column_sum",
                     f"sums fp32 per-block partials over blocks, {columns} columns",
                     abi=(P("partials", "const float*"), P("out", "T*"), P("splits", "int")),
                     returned=("out",), headers=("column_sum.cuh",), columns=columns, align=1)


class ColumnSum(KernelFamily):
    name = "column_sum"
    template = "column_sum/column_sum.cu.j2"
    launcher_template = "column_sum/column_sum.py.j2"
    head_template = "column_sum/column_sum_head.py.j2"
    head_position = 40  # kernels.KernelFamily.head_position
    sums_partials = True

    def launcher_io(self, spec):
        return dict(args=["partials", "dtype"], outputs=1, types={"dtype": "ScalarType"})


COLUMN_SUM = register_family(ColumnSum())
