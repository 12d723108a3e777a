"""Where a run's settings come from: ``[tool.fusegen]`` of a pyproject.toml, then the command line.

The pyproject.toml is found like ruff and black find theirs: the nearest one, searching upward from
the working directory, that has a ``[tool.fusegen]`` table. Paths in it are relative to its own
folder. The table is checked against ``SCHEMA``: wrong types, empty lists and unknown keys (with a
"did you mean") are ``UsageError``s naming the file; nothing is silently ignored or defaulted.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .kernels import DTYPES
from .ops.opdef import MAX_FEATURES

# Every GPU generation from Ampere on: a cubin per major NVRTC 13.0 builds, since a cubin runs on
# every later minor of its major (sm_80's on sm_86/87/88/89: A10, RTX 30 and 40, L4, L40; sm_100's
# on sm_103; sm_120's on sm_121), and PTX for the rest (sm_110), which the driver compiles on first
# load. sm_86 or sm_89 cubins of their own cost a rebuild 40% more time (two compiles more per
# kernel) for kernels that are bound by memory bandwidth; a project may still list them.
DEFAULT_ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120", "compute_80")
DEFAULT_DTYPES = tuple(DTYPES)  # every dtype the kernels are written for
DEFAULT_PACKAGE = "generated"
ARCH = re.compile(r"(sm|compute)_(\d+)")

# key -> (expected type, what the value is, example)
SCHEMA = {
    "specs": (list, "spec files or globs", '["specs/*.py"]'),
    "package": (str, "the output package folder", '"generated"'),
    "archs": (list, "GPU targets", '["sm_80", "sm_90", "sm_100", "sm_120", "compute_80"]'),
    "dtypes": (list, "dtypes to build kernels for", '["bfloat16", "float16", "float32"]'),
    "plugins": (list, "modules that register ops and fusion rules", '["mypkg.fusegen_ext"]'),
    "pipelines": (dict, "per-pipeline settings", "{ mlp = { features = [4096, 8192] } }"),
    "fp8": (list, "FP8 recipes the modules with GEMMs run under the package's autocast", '["delayed", "current"]'),
    "fp8_min_rows": (int, "rows from which FP8 modules run FP8 GEMMs (fewer: high precision, 0: always FP8)",
                     "2048"),
}
# [tool.fusegen.pipelines.<name>] keys -> (what the value is, example)
PIPELINE_SCHEMA = {
    "features": ("input sizes to build fixed-size kernels for, besides the size-generic ones", "[4096, 8192]"),
    "fp8": ("FP8 recipes this pipeline runs under autocast, instead of [tool.fusegen] fp8 ([] for none)",
            '["current"]'),
    "tensor_parallel_size": ("the ranks of the tensor-parallel group its TP ops split over (default 1)", "2"),
}
FP8_RECIPES = ("delayed", "current", "rowwise", "block")  # the runtime's fp8_recipes.RECIPES
# Below this many rows a module built for FP8 runs its high-precision path inside autocast (its
# CUDA graphs): on the H100 the Llama MLP block's FP8 training step lost to bf16's at 128 tokens
# (1.11 against 0.76 ms, current scaling), was even at 1,024 (1.53 to 1.93 against 1.70 to 1.75 ms
# over runs; delayed 2.29 ms) and won by 1.5x from 8,192 on (bench/results/fp8_h100.md). 0 keeps
# TE's behaviour: FP8 at any size.
FP8_MIN_ROWS = 2048


@dataclass(frozen=True)
class Fp8Build:
    """What a pipeline built for FP8 is built with: its recipes and the rows from which it runs
    FP8 GEMMs (``pipeline.Pipeline.fp8``)."""

    recipes: tuple[str, ...]
    min_rows: int


MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class Config:
    specs: tuple[Path, ...]
    out: Path
    archs: tuple[str, ...] = DEFAULT_ARCHS
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    root: Path = Path(".")  # paths in messages and generated files are shown relative to this
    source: Path | None = None  # the pyproject.toml the settings came from, if any
    plugins: tuple[str, ...] = ()  # modules imported (with ``root`` on sys.path) before specs are read
    # pipeline name -> input sizes its size-generic kernels are also specialised for
    features: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fp8: tuple[str, ...] = ()  # the FP8 recipes of every pipeline with a GEMM
    pipeline_fp8: tuple[tuple[str, tuple[str, ...]], ...] = ()  # pipeline name -> its own recipes
    tensor_parallel: tuple[tuple[str, tuple[int, ...]], ...] = ()  # pipeline name -> its tensor-parallel sizes
    fp8_min_rows: int = FP8_MIN_ROWS
    specs_named_on_command_line: bool = False  # a subset of the project's specs, maybe


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above ``start`` that has a [tool.fusegen] table."""
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file() and "fusegen" in read_pyproject(candidate).get("tool", {}):
            return candidate
    return None


def read_pyproject(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: cannot read it: {err}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        # tomllib's message ends with "(at line L, column C)": keep it, it is the location.
        raise UsageError(f"{path}: not valid TOML: {err}; fix the file") from None


def fusegen_table(path: Path) -> dict:
    """[tool.fusegen] of ``path``, validated against SCHEMA."""
    table = read_pyproject(path).get("tool", {}).get("fusegen", {})
    where = f"{path}: [tool.fusegen]"
    if not isinstance(table, dict):
        raise UsageError(f"{where} must be a table, e.g. [tool.fusegen] followed by key = value lines")
    for key, value in table.items():
        if key not in SCHEMA:
            close = difflib.get_close_matches(key, SCHEMA, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(SCHEMA)}"
            raise UsageError(f"{where} has an unknown key '{key}'; {hint}")
        kind, what, example = SCHEMA[key]
        if (not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0))
                or (kind is list and not all(isinstance(v, str) for v in value))):
            expected = {list: "a list of strings", str: "a string", dict: "a table", int: "an integer"}[kind]
            raise UsageError(f"{where} {key} must be {expected} ({what}), e.g. {key} = {example}; "
                             f"got {value!r}")
        if not value and kind is not int:
            raise UsageError(f"{where} {key} is empty; give {what}, e.g. {key} = {example}")
    return table


def pipeline_features(table: dict, where: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """[tool.fusegen.pipelines]: {pipeline name: {features = [sizes]}}, checked. Whether each name
    is a pipeline of the specs, and a size-generic one, is checked once they are read (build.py)."""
    result = []
    for name, settings in sorted(table.items()):
        at = f"{where}.pipelines.{name}"
        if not isinstance(settings, dict):
            raise UsageError(f"{at} must be a table, e.g. [tool.fusegen.pipelines.{name}] followed by "
                             f"features = {PIPELINE_SCHEMA['features'][1]}")
        for key in settings:
            if key not in PIPELINE_SCHEMA:
                close = difflib.get_close_matches(key, PIPELINE_SCHEMA, n=1)
                hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(PIPELINE_SCHEMA)}"
                raise UsageError(f"{at} has an unknown key '{key}'; {hint}")
        if not settings:
            raise UsageError(f"{at} is empty; give features = {PIPELINE_SCHEMA['features'][1]}, fp8 = "
                             f"{PIPELINE_SCHEMA['fp8'][1]} or tensor_parallel_size = "
                             f"{PIPELINE_SCHEMA['tensor_parallel_size'][1]}")
        if "features" not in settings:
            continue
        sizes = settings["features"]
        what, example = PIPELINE_SCHEMA["features"]
        if (not isinstance(sizes, list) or not sizes
                or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_FEATURES for v in sizes)):
            raise UsageError(f"{at} features must be a non-empty list of sizes from 1 to {MAX_FEATURES} ({what}), "
                             f"e.g. features = {example}; got {sizes!r}")
        result.append((name, tuple(sorted(set(sizes)))))
    return tuple(result)


def fp8_recipes(value, where: str, empty: bool = False) -> tuple[str, ...]:
    """An fp8 setting: a list of recipe names (FP8_RECIPES), each once, in FP8_RECIPES' order."""
    if (not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (not value and not empty)
            or any(v not in FP8_RECIPES for v in value)):
        raise UsageError(f"{where} fp8 must be a list of FP8 recipes from {list(FP8_RECIPES)} (delayed: TE's "
                         "DelayedScaling, current: Float8CurrentScaling, rowwise: per-row scales, block: "
                         "Float8BlockScaling), e.g. fp8 = "
                         f'["delayed", "current"]{"; [] builds none for this pipeline" if empty else ""}; got {value!r}')
    return tuple(name for name in FP8_RECIPES if name in value)


def pipeline_fp8(table: dict) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """[tool.fusegen.pipelines.<name>] fp8 settings (their tables already checked by
    pipeline_features), by name."""
    return tuple((name, fp8_recipes(settings["fp8"], f"[tool.fusegen.pipelines.{name}]", empty=True))
                 for name, settings in sorted(table.items()) if isinstance(settings, dict) and "fp8" in settings)


def pipeline_tensor_parallel(table: dict) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """[tool.fusegen.pipelines.<name>] tensor_parallel_size settings (their tables already checked
    by pipeline_features), by name: the group sizes from 1 on it is built for, ascending (a list
    builds one module a size, the constructor choosing by the group's)."""
    result = []
    for name, settings in sorted(table.items()):
        if not isinstance(settings, dict) or "tensor_parallel_size" not in settings:
            continue
        given = settings["tensor_parallel_size"]
        sizes = given if isinstance(given, list) else [given]
        if not sizes or len(set(map(repr, sizes))) != len(sizes) or any(
                isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1024 for size in sizes):
            what, example = PIPELINE_SCHEMA["tensor_parallel_size"]
            raise UsageError(f"[tool.fusegen.pipelines.{name}] tensor_parallel_size must be a whole number from 1 to "
                             f"1024 ({what}), or a list of distinct ones, e.g. tensor_parallel_size = {example} or "
                             f"[2, 4]; got {given!r}")
        result.append((name, tuple(sorted(sizes))))
    return tuple(result)


def split_list(text: str, option: str) -> tuple[str, ...]:
    """A comma-separated command-line list; empty items are an error, not a fallback."""
    items = tuple(item.strip() for item in text.split(","))
    if not text.strip() or not all(items):
        raise UsageError(f"{option} needs a comma-separated list without empty items, got {text!r}")
    return items


def check_dtypes(dtypes: tuple[str, ...], source: str) -> None:
    for dtype in dtypes:
        if dtype not in DTYPES:
            close = difflib.get_close_matches(dtype, DTYPES, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UsageError(f"{source}: unknown dtype {dtype!r}; {hint}choose from {', '.join(DTYPES)}")


def check_archs(archs: tuple[str, ...], supported: tuple[int, ...] | None, source: str) -> None:
    """Every arch is sm_XY or compute_XY, with XY among what the pinned NVRTC can build
    (``supported``; None checks the form only, for commands that compile nothing)."""
    for arch in archs:
        match = ARCH.fullmatch(arch)
        if match is None:
            raise UsageError(f"{source}: unknown arch {arch!r}; use names like sm_80, sm_90 or compute_80")
        if supported is not None and int(match[2]) not in supported:
            choices = ", ".join(f"sm_{n}" for n in supported)
            raise UsageError(f"{source}: arch {arch!r} is not supported by the pinned NVRTC; it builds "
                             f"{choices} (and compute_ of the same numbers)")


def resolve_specs(items: list[str], base: Path, source: str | None) -> tuple[Path, ...]:
    """Spec paths and globs, relative to ``base``; each must name at least one existing file.
    ``source``: where the list was written, for messages (None: the command line, which needs no
    naming: the CLI's "fusegen: error: " leads the message)."""
    where = f"{source}: " if source is not None else ""
    specs: list[Path] = []
    for item in items:
        path = base / item
        if any(c in item for c in "*?["):
            matches = sorted(p for p in path.parent.glob(path.name) if p.is_file())
            if not matches:
                raise UsageError(f"{where}no spec file matches {item!r} (in {path.parent})")
            specs.extend(matches)
        elif path.is_dir():
            raise UsageError(f"{where}spec {item!r} is a folder; name the spec files or a glob like "
                             f"'{Path(item) / '*.py'}'")
        elif not path.is_file():
            raise UsageError(f"{where}spec file {item!r} not found (looked for {path})")
        else:
            specs.append(path)
    return tuple(dict.fromkeys(specs))


def load_config(cli_specs: list[str], config: str | None, out: str | None, archs: str | None,
                dtypes: str | None, supported_archs: tuple[int, ...] | None, cwd: Path | None = None) -> Config:
    """The run's Config: command-line values win over [tool.fusegen], which wins over defaults.

    ``supported_archs`` is what NVRTC can build (None when nothing will be compiled: then arch
    names are checked for form only)."""
    cwd = cwd or Path.cwd()
    if config is not None:
        pyproject: Path | None = cwd / config
        if not pyproject.is_file():
            raise UsageError(f"config file {config} not found")
        if "fusegen" not in read_pyproject(pyproject).get("tool", {}):
            raise UsageError(f"{config} has no [tool.fusegen] table; add one (see the README)")
    else:
        pyproject = find_pyproject(cwd)
    table = fusegen_table(pyproject) if pyproject is not None else {}
    root = pyproject.parent if pyproject is not None else cwd
    # (the table's keys are read only where a pyproject.toml was found, so its name is at hand)
    source = f"{pyproject}: [tool.fusegen]" if pyproject is not None else "[tool.fusegen]"
    if cli_specs:
        specs = resolve_specs(cli_specs, cwd, None)
    elif "specs" in table:
        specs = resolve_specs(table["specs"], root, f"{source} specs")
    else:
        raise UsageError("no spec files: name them on the command line (fusegen generate a.py) or in "
                         "[tool.fusegen] specs of a pyproject.toml in this folder or above")
    if out is not None and not out.strip():
        raise UsageError("--out needs a folder name")
    out_path = cwd / out if out is not None else root / table.get("package", DEFAULT_PACKAGE)
    arch_list = split_list(archs, "--archs") if archs is not None else tuple(table.get("archs", DEFAULT_ARCHS))
    dtype_list = split_list(dtypes, "--dtypes") if dtypes is not None else tuple(table.get("dtypes", DEFAULT_DTYPES))
    check_dtypes(dtype_list, "--dtypes" if dtypes is not None else f"{source} dtypes")
    check_archs(arch_list, supported_archs, "--archs" if archs is not None else f"{source} archs")
    plugins = tuple(table.get("plugins", ()))
    for name in plugins:
        if not MODULE_NAME.fullmatch(name):
            raise UsageError(f"{source} plugins: {name!r} is not a module name; write a dotted import path "
                             "like 'mypkg.fusegen_ext' (the module is imported from the project folder)")
    features = pipeline_features(table.get("pipelines", {}), source)
    fp8 = fp8_recipes(table["fp8"], source) if "fp8" in table else ()
    return Config(specs, out_path, tuple(dict.fromkeys(arch_list)), tuple(dict.fromkeys(dtype_list)),
                  root=root.resolve(), source=pyproject, plugins=tuple(dict.fromkeys(plugins)), features=features,
                  fp8=fp8, pipeline_fp8=pipeline_fp8(table.get("pipelines", {})),
                  tensor_parallel=pipeline_tensor_parallel(table.get("pipelines", {})),
                  fp8_min_rows=table.get("fp8_min_rows", FP8_MIN_ROWS),
                  specs_named_on_command_line=bool(cli_specs))
