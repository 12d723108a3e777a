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
in fusegen, or an installation of it that is missing a part: please report it with the output of
--debug). Errors print as one message; only --debug shows a traceback.

This module is the program's entry point (the console script and ``python -m fusegen``) and
imports nothing of fusegen at its top: the commands (commands.py) are imported inside main's
handler, so an installation missing a module, or one that fails to import, is reported like any
other internal error (exit 70), not as a traceback and exit 1, which is --check's "stale".
"""

from __future__ import annotations

import argparse
import importlib.metadata
import signal
import sys
import threading
import traceback

EXIT_INTERNAL, EXIT_INTERRUPTED = 70, 130  # what main returns itself; a command's outcomes are commands.py's


def version() -> str:
    try:
        return importlib.metadata.version("fusegen")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


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
    """The top-level handler: every error leaves as one message and its exit code (commands.run
    reports the user's mistakes and toolchain failures; this, interrupts and fusegen's own failures).

    ``argv`` None is the program itself (the console script, ``python -m fusegen``): its
    arguments are the command line's, and after a Ctrl-C it ignores any further one, since it
    exits next and one landing in its last steps would end it by the signal, with a traceback or
    without the exit code 130."""
    args = parser().parse_args(argv)
    try:
        from . import commands  # here, inside the handler: a broken installation is an internal error

        return commands.run(args)
    except KeyboardInterrupt:
        if argv is None:
            ignore_ctrl_c()
        tell("fusegen: interrupted (every file is written whole or not at all)")
        return EXIT_INTERRUPTED
    except (Exception, SystemExit) as err:  # fusegen's own failure (SystemExit: code that should not exit)
        if args.debug:
            traceback.print_exc()
        tell(internal_error(err))
        return EXIT_INTERNAL


def internal_error(err: BaseException) -> str:
    """The one line that reports a failure of fusegen itself."""
    if isinstance(err, ImportError):  # a module missing from the installation, or one that fails to import
        module = err.name or "a module"
        if module.split(".")[0] == __package__:
            what, fix = "fusegen is installed incompletely", "reinstall fusegen"
        else:
            what, fix = "a dependency of fusegen is missing or broken", "reinstall fusegen with its dependencies"
        return (f"fusegen: internal error: {what}: cannot import {module} ({type(err).__name__}: {err}); {fix}, "
                "and if that does not help, report it with the output of --debug")
    return (f"fusegen: internal error: {type(err).__name__}: {err} (a bug in fusegen: please report it with "
            "the output of --debug)")


def ignore_ctrl_c() -> None:
    """SIGINT ignored from now on in this process, where that can be set (the main thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def tell(text: str) -> None:
    """``text`` on standard error. console.say's work, done here with nothing of fusegen: the
    message may be that fusegen's modules do not import. A reader that has left gets nothing."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: stderr closed
        pass


if __name__ == "__main__":
    sys.exit(main())
