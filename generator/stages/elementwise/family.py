"""The elementwise kernel families, elementwise_fwd and elementwise_bwd: how their kernels are
instantiated (templates/elementwise/*.cu.j2) and launched (templates/elementwise/*.py.j2), a grid
of blocks along the row and row splits across it."""

from __future__ import annotations

from ...kernels import DTYPES, KernelFamily, register_family
from ..launchers import by_dtype
from .kernels import COLUMN_TILE_LANES, COLUMN_TILED_ROWS
from .steps import random_operands


def by_row_vectors(spec, itemsize: int) -> int | None:
    """Blocks along the row ("row_vectors"), or elements per vector of a size-generic kernel
    ("any_row_vectors": its launcher computes the blocks from the run-time n)."""
    vec = spec.vec(itemsize)
    if spec.ctx.get("fp8_out"):  # an FP8 variant: a block a tile of 32 vectors (fp8_tile.cuh)
        return spec.ctx["width"] // vec // 32
    if spec.geometry == "row_vectors":
        return -(-spec.ctx["width"] // vec // spec.ctx["threads"])
    return vec if spec.geometry == "any_row_vectors" else None


def fixed_size_variant(spec) -> tuple[str, int] | None:
    """A fixed-size elementwise kernel: the size-generic kernel of its run (by name; a package may
    not have it) and its width."""
    return None if spec.ctx["generic"] else (spec.ctx["generic_name"], spec.ctx["width"])


def _amax_arg(spec, name: str = "amax") -> list[str]:
    """[``name``] for a kernel that keeps its output's amax (an FP8 GEMM reads the output), else
    []: its launcher's last argument, a float the kernel max-es the amax into, or None; off the
    GPU the runtime's fp8_reference_amax does it."""
    return [name] if spec.ctx.get("amax") else []


def _amax_type(spec) -> dict:
    """The amax argument's custom-op type: a tensor written in place, or None."""
    return {"amax": "Tensor(a!)?"} if spec.ctx.get("amax") else {}


# An FP8 variant's launcher arguments after its inputs (templates/elementwise/fp8_launch.py.j2): the
# scale or the finished amax it casts with, the float it keeps the amax in, the recipe's format
# and constants, whether it writes the transpose, whether it stores at all (current scaling's
# first launch keeps the amax alone). It returns the FP8 output, its transpose, the scale's inverse.
FP8_ARGS = ["scale", "amax", "amax_out", "e5m2", "eps_bits", "power_2", "transpose", "stores"]


def _fp8_io(spec, first: str) -> dict:
    """An FP8 variant's launcher_io (``first``: x or dy)."""
    return dict(args=[first, *spec.operands, *FP8_ARGS], outputs=3,
                random=random_operands(spec.ctx["steps"]) + ["scale", "amax", "amax_out"],
                types={"amax_out": "Tensor(a!)?", **{name: "int" for name in FP8_ARGS[3:]}})


def _fp8_runtime_names(spec) -> tuple[str, ...]:
    """What an FP8 GEMM producer's launcher takes from the runtime off the GPU: the amax (an
    ``_amax`` variant) or the cast (an ``_fp8`` variant) of its output."""
    return (*_amax_arg(spec, "fp8_reference_amax"), *(("fp8_reference_produced",) if spec.ctx.get("fp8_out") else ()))


class ElementwiseForward(KernelFamily):
    name = "elementwise_fwd"
    template = "elementwise/elementwise_fwd.cu.j2"
    launcher_template = "elementwise/elementwise_fwd.py.j2"
    head_template = "elementwise/elementwise_fwd_head.py.j2"
    head_position = 10  # kernels.KernelFamily.head_position

    def launch_size(self, spec, itemsize):
        return by_row_vectors(spec, itemsize)

    def fixed_size_variant(self, spec):
        return fixed_size_variant(spec)

    def launcher_io(self, spec):
        if spec.ctx.get("fp8_out"):
            return _fp8_io(spec, "x")
        written = [name for name in spec.returned if name != "y"]  # extra outputs the kernel writes
        return dict(args=["x", *spec.operands, *_amax_arg(spec)], outputs=1 + len(written), written=written,
                    random=random_operands(spec.ctx["steps"]) + _amax_arg(spec), types=_amax_type(spec))

    def runtime_names(self, spec):
        return super().runtime_names(spec) + _fp8_runtime_names(spec)


class ElementwiseBackward(KernelFamily):
    name = "elementwise_bwd"
    template = "elementwise/elementwise_bwd.cu.j2"
    launcher_template = "elementwise/elementwise_bwd.py.j2"
    head_template = "elementwise/elementwise_bwd_head.py.j2"
    head_position = 30  # kernels.KernelFamily.head_position
    module_constants = {"column_tiled_rows": COLUMN_TILED_ROWS, "column_tile_lanes": COLUMN_TILE_LANES}

    def launch_size(self, spec, itemsize):
        return by_row_vectors(spec, itemsize)

    def fixed_size_variant(self, spec):
        return fixed_size_variant(spec)

    def shared_bytes(self, spec):
        """A column-tiled backward's lane sums: a thread's vector of fp32 sums, in the widest
        vectors of any dtype. Its 4 KB a 128-thread block cost no occupancy."""
        if not spec.ctx["column_tiled"]:
            return 0
        return 4 * spec.ctx["threads"] * max(spec.vec(itemsize) for _, _, itemsize in DTYPES.values())

    def sums_itself_up_to(self, spec):
        return COLUMN_TILED_ROWS if spec.ctx["column_tiled"] else None

    def launcher_io(self, spec):
        if spec.ctx.get("fp8_out"):
            return _fp8_io(spec, "dy")
        return dict(args=["dy", *spec.operands, *_amax_arg(spec)], outputs=len(spec.returned),
                    random=random_operands(spec.ctx["steps"]) + _amax_arg(spec), types=_amax_type(spec))

    def runtime_names(self, spec):
        return super().runtime_names(spec) + _fp8_runtime_names(spec)

    def launcher_context(self, spec, dtypes):
        """A column-tiled backward's 16-byte (or narrower) vectors in a row of dy, by dtype (a
        launch's blocks each take a tile of them)."""
        if not spec.ctx["column_tiled"]:
            return dict(row_vectors="")
        return dict(row_vectors=by_dtype(lambda itemsize: spec.ctx["width"] // spec.vec(itemsize), dtypes))


ELEMENTWISE_FWD = register_family(ElementwiseForward())
ELEMENTWISE_BWD = register_family(ElementwiseBackward())
