"""The commands of the ``fusegen`` command line (cli.py parses the arguments and calls ``run``).

A user's mistake (spec, configuration, arguments, paths) and a toolchain failure leave ``run`` as
one message and its exit code; anything else is fusegen's own error, for cli.main to report.
"""

from __future__ import annotations

import argparse
import re
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

# A command's exit codes (cli.py's docstring lists every one; main returns 70 and 130 itself).
# Here, not in cli.py: cli imports this module, and an import back would close a circle.
EXIT_STALE, EXIT_USER, EXIT_TOOLCHAIN = 1, 2, 3


def load_config(args: argparse.Namespace, compiles: bool) -> cfg.Config:
    """The run's configuration; ``compiles`` checks archs against what NVRTC can build."""
    supported = None
    if compiles:
        from .toolchain import nvrtc  # raises ToolchainError when the pinned toolchain is missing

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
    from .ops import OPS, RESIDUAL, RESIDUAL_MODULES

    pyproject = Path.cwd() / args.config if args.config else cfg.find_pyproject(Path.cwd())
    if args.config and not pyproject.is_file():
        raise UsageError(f"config file {args.config} not found")
    table = cfg.fusegen_table(pyproject) if pyproject is not None else {}
    with plugins.loaded(tuple(table.get("plugins", ())), pyproject.parent if pyproject else Path.cwd()):
        for op in OPS.values():
            if op.modules:  # fusegen's internal basic ops (RowScale) are for containers only
                say(f"{op.signature()}\n    {op.summary}  (from {' or '.join(op.modules)})")
        modules = " or ".join(RESIDUAL_MODULES)
        say(f"{RESIDUAL}(*ops)\n    y = x + ops(x): a container of ops, nestable  (from {modules})")
    return 0


COMMANDS = {"generate": cmd_generate, "plan": cmd_plan, "explain": cmd_explain, "ops": cmd_ops}


def run(args: argparse.Namespace) -> int:
    """``args.command``'s exit code: a user's mistake or a toolchain failure is one message here;
    every other exception is fusegen's own and propagates (to cli.main)."""
    try:
        return COMMANDS[args.command](args)
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
