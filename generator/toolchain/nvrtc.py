"""Compile CUDA sources to cubins (sm_XX) or PTX (compute_XX) with NVRTC through cuda-bindings.

The toolchain is pinned in pyproject.toml (cuda-bindings, nvidia-cuda-nvrtc, nvidia-cuda-runtime
for cuda_bf16.h / cuda_fp16.h, and nvidia-cuda-nvcc for ptxas: ptxas.py), so the same source gives
the same bytes on every machine. No GPU is needed. The options carry no line info and no debug
info, so the absolute include paths never reach a binary; the manifest records the options with
the include folders written symbolically (``compile_options``) so it is identical on every machine
too.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable
from pathlib import Path

from ..errors import ToolchainError

try:
    from cuda.bindings import nvrtc
except ImportError as _err:  # fusegen's own dependency: a broken install, not a user mistake
    raise ToolchainError(f"cannot import NVRTC from cuda-bindings ({_err}); install the pinned toolchain: "
                         "pip install 'cuda-bindings==13.0.3' 'nvidia-cuda-nvrtc==13.0.88'") from None

RUNTIME_PACKAGE = "nvidia-cuda-runtime"
LANGUAGE_OPTIONS = ("--std=c++17",)
# Options that only make NVRTC faster; the binaries are byte-identical without them (checked over
# every shipped kernel). -minimal leaves out declarations no kernel uses (texture types, device
# runtime calls); --pch lets a compile reuse the headers an earlier one of the same process parsed
# (precompiled header files, in the folder compile_source is given). Together they take 10% off a
# rebuild.
SPEED_OPTIONS = ("-minimal", "--pch")
# What the real -I option stands for. fusegen's own headers are not on an include path: they are
# handed to NVRTC in memory (compile_source), which it prefers to any file, so a `common.cuh` or
# `kernels/norm.cuh` in the working directory can never be compiled in their place.
RECORDED_INCLUDES = (f"-I<{RUNTIME_PACKAGE}>/include",)


class NvrtcError(ToolchainError):
    pass


def _check(result, what: str, source_name: str = "") -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(result)
        prefix = f"{source_name}: " if source_name else ""
        raise NvrtcError(f"{prefix}{what} failed: {text.decode()}")


def _loaded(call, *args):
    """A first NVRTC call: cuda-bindings loads libnvrtc on it, so a missing or broken library shows
    here (cuda.pathfinder's DynamicLibNotFoundError and kin) and is the toolchain's error."""
    try:
        return call(*args)
    except Exception as err:  # noqa: BLE001 - whatever the loader raises
        raise ToolchainError(f"cannot load the NVRTC library ({type(err).__name__}: {err}); install the pinned "
                             "toolchain: pip install 'cuda-bindings==13.0.3' 'nvidia-cuda-nvrtc==13.0.88'") from None


def nvrtc_version() -> str:
    result, major, minor = _loaded(nvrtc.nvrtcVersion)
    _check(result, "nvrtcVersion")
    return f"{major}.{minor}"


def supported_archs() -> tuple[int, ...]:
    """The XY of every sm_XY this NVRTC can compile for (its own list, not a guess)."""
    result, archs = _loaded(nvrtc.nvrtcGetSupportedArchs)
    _check(result, "nvrtcGetSupportedArchs")
    return tuple(archs)


def cuda_include_dir() -> Path:
    """The CUDA headers (cuda_bf16.h, cuda_fp16.h) shipped by the nvidia-cuda-runtime wheel."""
    hint = (f"install the pinned {RUNTIME_PACKAGE} package "
            f"(pip install '{RUNTIME_PACKAGE}==13.0.96')")
    try:
        dist = importlib.metadata.distribution(RUNTIME_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise NvrtcError(f"CUDA headers not found: {hint}") from None
    include = Path(dist.locate_file("nvidia/cu13/include"))
    if not (include / "cuda_bf16.h").is_file():
        raise NvrtcError(f"CUDA headers not found: {include / 'cuda_bf16.h'} is missing; {hint}")
    return include


def _arch_option(target: str) -> str:
    return f"--gpu-architecture={target}"


def compile_options(arch: str) -> list[str]:
    """The options of a compile for ``arch`` as recorded in MANIFEST.json (no machine-specific paths)."""
    return [_arch_option(arch), *LANGUAGE_OPTIONS, *SPEED_OPTIONS, *RECORDED_INCLUDES]


# {sm arch: the arch whose compile's PTX it is assembled from (ptxas.py)}. NVRTC 13.0 has two
# NVVMs: one for sm_80 and sm_90 (based on LLVM 7), one for sm_100 and up (LLVM 20). For a source
# that does not test the arch, each writes the same PTX for the two archs of a pair but for the
# .target line: the CUDA headers are what could tell them apart, and
# - sm_100 / sm_120: no conditional of the pinned headers does (their __CUDA_ARCH__ tests stop at
#   1000; the family-specific macros are set only for sm_XYf and sm_XYa, which fusegen does not
#   build), so the PTX is the same for any such source;
# - sm_80 / sm_90: the headers' paths for newer archs (sm_90's cvt.f32.bf16 for bf16 -> fp32 and
#   bf16 arithmetic, sm_89's fp8 conversions) are never reached by fusegen's kernels, which convert
#   bf16 with common.cuh's own mov and compute in fp32 (the PTX is the same for every shipped
#   kernel). A plugin kernel that calls a header function with such a path gets on sm_90 the sm_80
#   path's code: the same function, the code the compute_80 PTX runs on every later GPU as well.
# Assembling the PTX gives the machine code NVRTC's own compile for the arch gives (every section of
# the cubin but the toolkit note; checked over every shipped kernel, and a test keeps checking one
# of each template) without running the front end and NVVM again: over the shipped sources,
# NVRTC's 26.7 s for sm_120 became 11.6 s of ptxas, and a full rebuild (224 compiles, 224 ptxas
# runs) took 37-42 s where the tree with 448 compiles took 54-58 s, run in turn (2-core machine).
ASSEMBLED_FROM = {"sm_90": "sm_80", "sm_120": "sm_100"}
# What in a source or a fusegen or plugin header tests the arch (nv/target's macros test it too):
# such a kernel is compiled for each arch by itself.
TESTS_ARCH = re.compile(r"__CUDA_ARCH|\bNV_(?:IF_TARGET|IF_ELSE_TARGET|DISPATCH_TARGET|PROVIDES_SM|IS_EXACTLY_SM"
                        r"|HAS_FEATURE)")


def compiled_with(target: str, targets: Iterable[str], tests_arch: bool = False) -> str:
    """The arch of the compile that gives ``target`` when a build makes all of ``targets``.

    A compile for sm_XY leaves PTX behind as well, the same bytes as a compile for compute_XY
    gives (checked over every shipped kernel; a test keeps checking it), so compute_XY comes from
    the sm_XY compile whenever both are wanted: one compile where there were two. An arch of
    ASSEMBLED_FROM comes from its twin's compile too, unless the kernel ``tests_arch``."""
    kind, _, number = target.partition("_")
    if kind == "compute":
        return f"sm_{number}" if f"sm_{number}" in targets else target
    twin = ASSEMBLED_FROM.get(target)
    return twin if twin in targets and not tests_arch else target


def targets_of(arch: str, with_ptx: bool = False) -> tuple[str, ...]:
    """The binaries one NVRTC compile for ``arch`` gives: its own, and with ``with_ptx`` an sm_XY
    compile's PTX as compute_XY too."""
    kind, _, number = arch.partition("_")
    return (arch, f"compute_{number}") if with_ptx and kind == "sm" else (arch,)


def _read(prog, get_size, get, what: str, source_name: str) -> bytes:
    result, size = get_size(prog)
    _check(result, f"{what}Size", source_name)
    # A fresh bytearray: the binding writes into the buffer it is given, and a bytes object
    # made by repetition may be a shared interned constant.
    buffer = bytearray(size)
    (result,) = get(prog, buffer)
    _check(result, what, source_name)
    return bytes(buffer)


def _compile(prog, source_name: str, arch: str, targets: tuple[str, ...], include_dirs: list[Path],
             pch_dir: Path) -> dict[str, bytes]:
    options = [_arch_option(arch), *LANGUAGE_OPTIONS, *SPEED_OPTIONS, f"--pch-dir={pch_dir}",
               *(f"-I{d}" for d in include_dirs)]
    (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        # The log holds the compiler's diagnostics (also for a bad option such as an unknown arch).
        log = _read(prog, nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, "nvrtcGetProgramLog", source_name)
        text = log.rstrip(b"\0").decode(errors="replace").strip() or nvrtc.nvrtcGetErrorString(result)[1].decode()
        raise NvrtcError(f"{source_name}: NVRTC failed for {arch}:\n{text}")
    binaries = {}
    for target in targets:
        if target.startswith("compute_"):
            ptx = _read(prog, nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, "nvrtcGetPTX", source_name)
            binaries[target] = ptx.rstrip(b"\0")  # the size counts the C string's terminator
        else:
            binaries[target] = _read(prog, nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, "nvrtcGetCUBIN", source_name)
    return binaries


def compile_source(source: str, source_name: str, target: str, headers: dict[str, str],
                   include_dirs: list[Path], pch_dir: Path, with_ptx: bool = False) -> dict[str, bytes]:
    """Compile one translation unit for ``target`` (sm_XY: a cubin, compute_XY: PTX text);
    {target: bytes}, and with ``with_ptx`` an sm_XY compile's PTX under compute_XY too.

    ``source_name`` is the relative name shown in messages (e.g. "kernels/x_bf16.cu");
    ``headers`` ({include name: text}) are given in memory; ``include_dirs`` serve the rest
    (CUDA's own headers). ``pch_dir`` is a folder of the caller's where NVRTC writes precompiled
    headers (otherwise it leaves them in the system's temporary folder, never removed)."""
    if target.partition("_")[0] not in ("sm", "compute"):
        raise NvrtcError(f"{source_name}: unknown target {target!r}; expected sm_XY or compute_XY")
    names = sorted(headers)
    result, prog = nvrtc.nvrtcCreateProgram(source.encode(), source_name.encode(), len(names),
                                            [headers[n].encode() for n in names], [n.encode() for n in names])
    _check(result, "nvrtcCreateProgram", source_name)
    try:
        binaries = _compile(prog, source_name, target, targets_of(target, with_ptx), include_dirs, pch_dir)
    except BaseException:
        nvrtc.nvrtcDestroyProgram(prog)  # best effort: the compile error is the one to report
        raise
    (result,) = nvrtc.nvrtcDestroyProgram(prog)
    _check(result, "nvrtcDestroyProgram", source_name)
    return binaries
