"""The ``fusegen`` command line (also ``python -m fusegen``).

    fusegen generate            compile the specs named in [tool.fusegen] of the nearest pyproject.toml
    fusegen generate a.py b.py --out pkg/generated
    fusegen generate --check    exit 1 and show a diff if the output package is stale
    fusegen plan specs/x.py     print the fusion plans of a spec file, compile nothing
    fusegen explain KERNEL      one kernel: specialisation, options, binaries' registers, source
    fusegen ops                 list every op a spec can use (the plugins' of [tool.fusegen] included)

[tool.fusegen] keys: specs (list of paths or globs), package (output folder),
archs (default sm_80, sm_90, compute_80), dtypes (default bfloat16, float16, float32), plugins
(modules that register ops and fusion rules; see the README).

Exit codes: 0 success, 1 stale output (--check), 2 a user error (spec, configuration, arguments,
paths), 3 a toolchain failure (NVRTC, CUDA headers), 130 interrupted, 70 an internal error (a bug
in fusegen: please report it with the output of --debug). Errors print as one message; only
--debug shows a traceback.
"""

from __future__ import annotations

import argparse
import re
import importlib.metadata
import shlex
import sys
import traceback
from pathlib import Path

from . import build, output, plugins
from . import config as cfg
from . import progress as prog
from .console import counted, say
from .errors import SpecError, ToolchainError, UsageError
from .explain import explain
from .staleness import staleness

EXIT_STALE, EXIT_USER, EXIT_TOOLCHAIN, EXIT_INTERNAL, EXIT_INTERRUPTED = 1, 2, 3, 70, 130


def version() -> str:
    try:
        return importlib.metadata.version("fusegen")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def load_config(args: argparse.Namespace, compiles: bool) -> cfg.Config:
    """The run's configuration; ``compiles`` checks archs against what NVRTC can build."""
    supported = None
    if compiles:
        from . import nvrtc  # raises ToolchainError when the pinned toolchain is missing

        supported = nvrtc.supported_archs()
    return cfg.load_config(args.specs, args.config, args.out, args.archs, args.dtypes, supported)


def shown(path: Path) -> str:
    return output.display_path(path, Path.cwd())


def regenerate_command(args: argparse.Namespace, config: cfg.Config) -> str:
    """How to regenerate this output, as the user would type it (their repository may have no make)."""
    words = ["fusegen", "generate", *args.specs]
    for option in ("config", "out", "archs", "dtypes"):
        if getattr(args, option) is not None:
            words += [f"--{option}", getattr(args, option)]
    command = f"`{shlex.join(words)}`"
    if config.source is not None and not args.specs:
        command += f" (it reads [tool.fusegen] of {shown(config.source)})"
    return command


def cmd_generate(args: argparse.Namespace) -> int:
    config = load_config(args, compiles=True)
    out, where = config.out, shown(config.out)
    output.check_output_folder(out, config.specs, Path.cwd())
    report = prog.for_stream(sys.stderr)
    if args.check:
        # Build against the checked-in package: binaries it already holds are reused only when
        # their source, options, NVRTC version and sha256 all match its MANIFEST.json.
        files = build.build_package(config, report)
        found = staleness(files, out, where)
        if found.stale:
            for line in found.report(where):  # the diff on stdout, for a reviewer or `| less`
                say(line)
            say(f"fusegen: {where} is stale: {found.summary()}; run {regenerate_command(args, config)} "
                "and commit the result", sys.stderr)
            return EXIT_STALE
        say(f"fusegen: {where} is up to date ({counted(len(files), 'file')})", sys.stderr)
        return 0
    checked: list[set[str]] = []

    def check_names(names: set[str]) -> None:  # before any compile: a refusal costs no minutes of NVRTC
        output.check_output_folder(out, config.specs, Path.cwd(), names)
        checked.append(names)

    files = build.build_package(config, report, reuse=not args.rebuild, before_compiling=check_names)
    if checked != [set(files)]:  # a file the check did not see would be written unchecked
        raise AssertionError("the package's files are not those checked before compiling")
    written, removed = output.write_package(files, out)
    say(f"fusegen: {where}: {counted(len(files), 'file')}, {len(written)} written, {len(removed)} removed",
        sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Each pipeline's plan: the tables of its <pipeline>.plan.md (the diagrams are for GitHub)."""
    config = load_config(args, compiles=False)
    for text in build.plan_documents(config).values():
        say(re.sub(r"```mermaid\n.*?```\n\n", "", text, flags=re.S))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """One kernel of the output package (explain.py)."""
    args.specs, args.archs, args.dtypes = [], None, None
    config = load_config(args, compiles=False)
    say(explain(config.out, shown(config.out), args.kernel))
    return 0


def cmd_ops(args: argparse.Namespace) -> int:
    """Every registered op: its signature, what it computes, where a spec imports it from."""
    from .ops import OPS

    pyproject = Path.cwd() / args.config if args.config else cfg.find_pyproject(Path.cwd())
    if args.config and not pyproject.is_file():
        raise UsageError(f"config file {args.config} not found")
    table = cfg.fusegen_table(pyproject) if pyproject is not None else {}
    with plugins.loaded(tuple(table.get("plugins", ())), pyproject.parent if pyproject else Path.cwd()):
        for op in OPS.values():
            if op.modules:  # fusegen's internal basic ops (RowScale) are for containers only
                say(f"{op.signature()}\n    {op.summary}  (from {' or '.join(op.modules)})")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fusegen", description="Ahead-of-time fusion compiler for te.ops pipelines.")
    top.add_argument("--version", action="version", version=f"fusegen {version()}")
    sub = top.add_subparsers(dest="command", required=True)
    for name, help_text in (("generate", "compile specs into the output package"),
                            ("plan", "print the fusion plans of specs")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("specs", nargs="*", help="spec files (default: [tool.fusegen] specs)")
        p.add_argument("--config", help="pyproject.toml holding [tool.fusegen] "
                                        "(default: the nearest one at or above the working directory)")
        p.add_argument("--out", help="output package folder (default: [tool.fusegen] package)")
        p.add_argument("--archs", help="comma-separated targets, e.g. sm_80,sm_90,compute_80")
        p.add_argument("--dtypes", help="comma-separated dtypes, e.g. bfloat16,float32")
        p.add_argument("--debug", action="store_true", help="show a traceback with every error")
        if name == "generate":
            p.add_argument("--check", action="store_true", help="exit 1 if the output package is stale")
            p.add_argument("--rebuild", action="store_true", help="recompile every kernel, reuse nothing")
    p = sub.add_parser("explain", help="show one kernel of the output package: specialisation, NVRTC options, "
                                       "per-arch binary size, registers and stack frame, source")
    p.add_argument("kernel", help="a kernel's name, e.g. rmsnorm_fwd_h4096 (a dtype suffix is optional)")
    p.add_argument("--config", help="pyproject.toml holding [tool.fusegen] "
                                    "(default: the nearest one at or above the working directory)")
    p.add_argument("--out", help="output package folder (default: [tool.fusegen] package)")
    p.add_argument("--debug", action="store_true", help="show a traceback with every error")
    p = sub.add_parser("ops", help="list every op a spec can use, with its signature")
    p.add_argument("--config", help="pyproject.toml whose [tool.fusegen] plugins to load")
    p.add_argument("--debug", action="store_true", help="show a traceback with every error")
    return top


def main(argv: list[str] | None = None) -> int:
    """The one top-level handler: every error leaves as one message and its exit code."""
    args = parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "plan": cmd_plan, "explain": cmd_explain, "ops": cmd_ops}[args.command](args)
    except KeyboardInterrupt:
        say("fusegen: interrupted (every file is written whole or not at all)", sys.stderr)
        return EXIT_INTERRUPTED
    except (SpecError, UsageError, ToolchainError) as err:
        if args.debug:
            traceback.print_exc()
        prefix = "" if isinstance(err, SpecError) and err.location is not None else "fusegen: error: "
        say(f"{prefix}{err}", sys.stderr)
        return EXIT_TOOLCHAIN if isinstance(err, ToolchainError) else EXIT_USER
    except OSError as err:  # the file system said no: permissions, a full disk, a vanished folder
        if args.debug:
            traceback.print_exc()
        say(f"fusegen: error: {err}", sys.stderr)
        return EXIT_USER
    except Exception as err:  # a bug in fusegen, not the user's mistake
        if args.debug:
            traceback.print_exc()
        say(f"fusegen: internal error: {type(err).__name__}: {err}\n"
            "This is a bug in fusegen; rerun with --debug for the traceback and report it.", sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
