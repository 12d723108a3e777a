"""Compile CUDA sources to cubins (sm_XX) or PTX (compute_XX) with NVRTC through cuda-python.

The toolchain is pinned in pyproject.toml (cuda-bindings, nvidia-cuda-nvrtc, and
nvidia-cuda-runtime for cuda_bf16.h / cuda_fp16.h), so the same source gives the same bytes on
every machine. No GPU is needed. Options carry no line info and no absolute paths reach the output;
the manifest records the options with the include folders written symbolically.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cuda.bindings import nvrtc

LANGUAGE_OPTIONS = ("--std=c++17",)
RECORDED_INCLUDES = ("-I<templates/cuda>", "-I<nvidia-cuda-runtime>/include")


class NvrtcError(RuntimeError):
    pass


def _check(result, what: str, source_name: str = "") -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(result)
        raise NvrtcError(f"{source_name}: {what} failed: {text.decode()}")


def nvrtc_version() -> str:
    result, major, minor = nvrtc.nvrtcVersion()
    _check(result, "nvrtcVersion")
    return f"{major}.{minor}"


def cuda_include_dir() -> Path:
    """The CUDA headers shipped by the nvidia-cuda-runtime wheel (nvidia/cu13/include)."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "cu13" / "include"
        if (candidate / "cuda_bf16.h").is_file():
            return candidate
    raise NvrtcError("CUDA headers (cuda_bf16.h) not found: install the pinned nvidia-cuda-runtime "
                     "package (pip install 'nvidia-cuda-runtime==13.0.96') or run `make setup`")


def _arch_option(target: str) -> str:
    return f"--gpu-architecture={target}"


def compile_options(target: str) -> list[str]:
    """The options of a compile as recorded in MANIFEST.json (no machine-specific paths)."""
    return [_arch_option(target), *LANGUAGE_OPTIONS, *RECORDED_INCLUDES]


def compile_source(source: str, source_name: str, target: str, include_dirs: list[Path]) -> bytes:
    """Compile one translation unit: a cubin for sm_XX targets, PTX text for compute_XX."""
    result, prog = nvrtc.nvrtcCreateProgram(source.encode(), source_name.encode(), 0, [], [])
    _check(result, "nvrtcCreateProgram", source_name)
    try:
        options = [_arch_option(target), *LANGUAGE_OPTIONS, *(f"-I{d}" for d in include_dirs)]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"{source_name}: NVRTC failed for {target}:\n{log.decode(errors='replace').rstrip(chr(0))}")
        if target.startswith("compute_"):
            result, size = nvrtc.nvrtcGetPTXSize(prog)
            _check(result, "nvrtcGetPTXSize", source_name)
            data = b" " * size
            (result,) = nvrtc.nvrtcGetPTX(prog, data)
            _check(result, "nvrtcGetPTX", source_name)
            return data.rstrip(b"\0")
        result, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(result, "nvrtcGetCUBINSize", source_name)
        data = b" " * size
        (result,) = nvrtc.nvrtcGetCUBIN(prog, data)
        _check(result, "nvrtcGetCUBIN", source_name)
        return data
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
