"""The quantize family's specs and its KernelFamily: templates/quantize/ (its .cu.j2 and
launchers) and templates/cuda/quantize.cuh (its math). Its kernels take any size at run time (one
kernel a format serves every GEMM operand of every pipeline), so their names carry no width."""

from __future__ import annotations

from ...kernels import KernelFamily, KernelParam, KernelSpec, kernel_name, make_spec, register_family

# the FP8 formats: (kernel name part, CUDA type, largest value, torch dtype)
FORMATS = {"e4m3": ("__nv_fp8_e4m3", 448, "float8_e4m3fn"), "e5m2": ("__nv_fp8_e5m2", 57344, "float8_e5m2")}
AMAX_THREADS = 256
UPDATE_THREADS = 256  # a block of delayed scaling's update: the threads share a slot's history rows


def fp8_amax() -> KernelSpec:
    """max |x| of a whole tensor (current scaling's first pass), into a float."""
    P = KernelParam
    return make_spec(kernel_name("fp8_amax", ""), "quantize", "max |x| over a tensor (FP8 current scaling's amax)",
                     abi=(P("x", "const T*"), P("amax", "float*"), P("n", "int")), returned=("amax",),
                     headers=("quantize.cuh",), kind="amax", align=8)


def fp8_cast(fmt: str) -> KernelSpec:
    """x [rows, cols] cast to FP8 ``fmt`` with a scale (given, or from a finished amax pass),
    optionally its transpose too, the scale's inverse, and x's amax max-ed into a given float."""
    P = KernelParam
    ctype, largest, _ = FORMATS[fmt]
    return make_spec(kernel_name("fp8_cast", fmt), "quantize",
                     f"x * scale to FP8 {fmt.upper()} saturating (and its transpose, the inverse scale, the amax)",
                     abi=(P("x", "const T*"), P("y", "unsigned char*"), P("y_t", "unsigned char*"),
                          P("scale", "const float*"), P("amax", "const float*"), P("scale_inv", "float*"),
                          P("amax_out", "float*"), P("rows", "int"), P("cols", "int"), P("t_cols", "int"),
                          P("eps_bits", "int"), P("power_2", "int")),
                     returned=("y", "y_t", "scale_inv"), headers=("quantize.cuh",), kind="cast",
                     fmt=fmt, fp8_type=ctype, fp8_max=largest, torch_dtype=FORMATS[fmt][2], align=8)


def fp8_delayed_update() -> KernelSpec:
    """Delayed scaling's update of one state's scales and amax history after a step (TE's fused
    kernel): one launch a state and mode where torch's ops took some twenty."""
    P = KernelParam
    return make_spec(kernel_name("fp8_delayed_update", ""), "quantize",
                     "delayed scaling's amax history roll and scale update (TE's fused kernel)",
                     abi=(P("history", "float*"), P("scale", "float*"), P("amax", "const float*"),
                          P("length", "int"), P("n", "int"), P("most_recent", "int"), P("scaled_max_bits", "int")),
                     returned=("history", "scale"), headers=("quantize.cuh",), kind="update", align=8)


def fp8_cast_rows(fmt: str) -> KernelSpec:
    """The row-wise recipe's cast of x [rows, cols] to ``fmt`` with a scale per row (a block a row)."""
    P = KernelParam
    ctype, largest, torch_dtype = FORMATS[fmt]
    return make_spec(kernel_name("fp8_cast_rows", fmt), "quantize",
                     f"x cast to FP8 {fmt.upper()} with a power-of-2 scale per row (torchao's rowwise)",
                     abi=(P("x", "const T*"), P("y", "unsigned char*"), P("scale_inv", "float*"), P("cols", "int"),
                          P("power_2", "int")),
                     returned=("y", "scale_inv"), headers=("quantize.cuh",), kind="rows", fmt=fmt, fp8_type=ctype,
                     fp8_max=largest, torch_dtype=torch_dtype, align=8)


def fp8_amax_cols() -> KernelSpec:
    """max |x| per column of x [rows, cols] (the row-wise recipe's weight-grad operands)."""
    P = KernelParam
    return make_spec(kernel_name("fp8_amax_cols", ""), "quantize", "max |x| per column",
                     abi=(P("x", "const T*"), P("amax", "float*"), P("rows", "int"), P("cols", "int")),
                     returned=("amax",), headers=("quantize.cuh",), kind="amax_cols", align=8)


def fp8_cast_cols(fmt: str) -> KernelSpec:
    """x [rows, cols] cast to ``fmt`` with a scale per column (from fp8_amax_cols), written
    transposed [cols, rows rounded up to 16]: the row-wise recipe's weight-grad operands."""
    P = KernelParam
    ctype, largest, torch_dtype = FORMATS[fmt]
    return make_spec(kernel_name("fp8_cast_cols", fmt), "quantize",
                     f"x cast to FP8 {fmt.upper()} with a power-of-2 scale per column, transposed",
                     abi=(P("x", "const T*"), P("y_t", "unsigned char*"), P("amax", "const float*"),
                          P("scale_inv", "float*"), P("rows", "int"), P("cols", "int"), P("t_cols", "int"),
                          P("power_2", "int")),
                     returned=("y_t", "scale_inv"), headers=("quantize.cuh",), kind="cols", fmt=fmt, fp8_type=ctype,
                     fp8_max=largest, torch_dtype=torch_dtype, align=8)


def fp8_cast_blocks(fmt: str) -> KernelSpec:
    """Float8BlockScaling's cast of x [rows, cols] to ``fmt`` with a scale per 1x128 or 128x128
    block: its row-wise copy and its transposed one [cols, rows rounded up to 128], each cast from
    x in one pass, with their inverse scales (quantize_blocks.cuh)."""
    P = KernelParam
    ctype, largest, torch_dtype = FORMATS[fmt]
    return make_spec(kernel_name("fp8_cast_blocks", fmt), "quantize",
                     f"x cast to FP8 {fmt.upper()} with a scale per 1x128 or 128x128 block, and transposed "
                     "(TE's Float8BlockScaling)",
                     abi=(P("x", "const T*"), P("y", "unsigned char*"), P("s", "float*"), P("y_t", "unsigned char*"),
                          P("s_t", "float*"), P("rows", "int"), P("cols", "int"), P("t_cols", "int"),
                          P("square", "int"), P("eps_bits", "int"), P("power_2", "int")),
                     returned=("y", "s", "y_t", "s_t"), headers=("quantize_blocks.cuh",), kind="blocks", fmt=fmt,
                     fp8_type=ctype, fp8_max=largest, torch_dtype=torch_dtype, align=8)


def fp8_kernels(recipes: tuple[str, ...]) -> list[KernelSpec]:
    """What a pipeline built for FP8 ``recipes`` launches around its GEMMs: the amax pass, a cast a
    format, delayed scaling's update, the row-wise recipe's casts per row and per column, and where
    it is built for block scaling that recipe's casts."""
    return [fp8_amax(), *(fp8_cast(fmt) for fmt in FORMATS), fp8_delayed_update(),
            *(fp8_cast_rows(fmt) for fmt in FORMATS), fp8_amax_cols(), *(fp8_cast_cols(fmt) for fmt in FORMATS),
            *(fp8_cast_blocks(fmt) for fmt in FORMATS if "block" in recipes)]


class Quantize(KernelFamily):
    name = "quantize"
    template = "quantize/quantize.cu.j2"
    launcher_template = "quantize/quantize.py.j2"
    head_position = 50
    module_constants = {"amax_threads": AMAX_THREADS, "update_threads": UPDATE_THREADS}

    def built_dtypes(self, spec, dtypes):
        # delayed scaling's update reads and writes the fp32 state alone, whatever the activations
        return ("float32",) if spec.ctx["kind"] == "update" else dtypes

    def template_context(self, spec, dtype, itemsize):
        return {"amax_threads": AMAX_THREADS, "update_threads": UPDATE_THREADS}

    def launcher_io(self, spec):
        if spec.ctx["kind"] in ("amax", "amax_cols"):
            return dict(args=["x"], outputs=1)
        if spec.ctx["kind"] == "rows":
            return dict(args=["x", "power_2"], outputs=2, types={"power_2": "int"})
        if spec.ctx["kind"] == "cols":
            return dict(args=["x", "amax", "power_2"], outputs=2, types={"power_2": "int"})
        if spec.ctx["kind"] == "blocks":
            return dict(args=["x", "square", "eps_bits", "power_2", "rows_out", "columns_out"], outputs=4,
                        types={name: "int" for name in ("square", "eps_bits", "power_2", "rows_out", "columns_out")})
        if spec.ctx["kind"] == "update":
            return dict(args=["history", "scale", "amax", "most_recent", "scaled_max_bits"], outputs=2,
                        random=["amax"], types={"most_recent": "int", "scaled_max_bits": "int"})
        return dict(args=["x", "scale", "amax", "eps_bits", "power_2", "transpose", "amax_out"], outputs=3,
                    random=["scale", "amax", "amax_out"],
                    types={"eps_bits": "int", "power_2": "int", "transpose": "int", "amax_out": "Tensor(a!)?"})

    def runtime_names(self, spec):
        return {"amax": ("fp8_reference_amax",), "cast": ("fp8_reference_cast",),
                "update": ("fp8_reference_delayed_update",), "rows": ("fp8_reference_cast_rows",),
                "amax_cols": ("fp8_reference_amax_cols",), "cols": ("fp8_reference_cast_cols",),
                "blocks": ("fp8_reference_cast_blocks",)}[spec.ctx["kind"]]


QUANTIZE = register_family(Quantize())
