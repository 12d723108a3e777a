"""The ``fusegen`` command line.

    fusegen generate            compile the specs named in [tool.fusegen] of ./pyproject.toml
    fusegen generate a.py b.py --out pkg/generated
    fusegen generate --check    exit 1 and name the files if the output package is stale
    fusegen plan specs/x.py     print the fusion plans of a spec file, compile nothing

[tool.fusegen] keys: specs (list of paths or globs), package (output folder),
archs (default sm_80, sm_90, compute_80), dtypes (default bfloat16, float16, float32).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from . import build
from .errors import SpecError

KNOWN_ARCH_PREFIXES = ("sm_", "compute_")


def load_config(args: argparse.Namespace) -> build.Config:
    pyproject = Path(args.config)
    settings: dict = {}
    root = pyproject.parent if pyproject.is_file() else Path(".")
    if pyproject.is_file():
        settings = tomllib.loads(pyproject.read_text()).get("tool", {}).get("fusegen", {})
    elif args.config != "pyproject.toml":
        raise SystemExit(f"fusegen: config file {args.config} not found")
    spec_args = args.specs or settings.get("specs")
    if not spec_args:
        raise SystemExit("fusegen: no spec files: name them on the command line or in [tool.fusegen] specs "
                         f"of {pyproject}")
    specs: list[Path] = []
    for item in spec_args:
        base = Path(item) if args.specs else root / item
        matches = sorted(base.parent.glob(base.name)) if any(c in item for c in "*?[") else [base]
        if not matches or not all(m.is_file() for m in matches):
            raise SystemExit(f"fusegen: spec file {item} not found")
        specs.extend(matches)
    out = Path(args.out) if args.out else root / settings.get("package", "generated")
    archs = tuple(args.archs.split(",")) if args.archs else tuple(settings.get("archs", build.DEFAULT_ARCHS))
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else tuple(settings.get("dtypes", build.DEFAULT_DTYPES))
    for arch in archs:
        if not arch.startswith(KNOWN_ARCH_PREFIXES) or not arch.split("_", 1)[1].isdigit():
            raise SystemExit(f"fusegen: unknown arch {arch!r}; use names like sm_80, sm_90, compute_80")
    for dtype in dtypes:
        if dtype not in build.kn.DTYPES:
            raise SystemExit(f"fusegen: unknown dtype {dtype!r}; choose from {', '.join(build.kn.DTYPES)}")
    return build.Config(tuple(dict.fromkeys(specs)), out, archs, dtypes, root=root.resolve())


def cmd_generate(args: argparse.Namespace) -> int:
    config = load_config(args)
    log = build.main_log
    if args.check:
        # Build against the checked-in package: binaries it already holds are reused only when
        # their source, options, NVRTC version and sha256 all match its MANIFEST.json.
        files = build.build_package(config, log)
        stale = build.stale_files(files, config.out)
        if stale:
            print(f"fusegen: {config.out} is stale; run `make generate` and commit the result. Files:", file=sys.stderr)
            for rel in stale:
                print(f"  {config.out / rel}", file=sys.stderr)
            return 1
        print(f"fusegen: {config.out} is up to date ({len(files)} files)", file=sys.stderr)
        return 0
    files = build.build_package(config, log, reuse=not args.rebuild)
    written, removed = build.write_package(files, config.out)
    print(f"fusegen: {config.out}: {len(files)} files, {len(written)} written, {len(removed)} removed", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    config = load_config(args)
    for plan in build.load_plans(config):
        print(f"{plan.pipeline.name} ({plan.pipeline.location})")
        for title, stages in (("forward", plan.forward), ("backward", plan.backward)):
            print(f"  {title}:")
            for n, stage in enumerate(stages):
                ops = ", ".join(op.describe() for op in stage.ops)
                print(f"    {n}. [{stage.rule.name}] {stage.kind}: {ops}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusegen", description="Ahead-of-time fusion compiler for te.ops pipelines.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("generate", "compile specs into the output package"),
                            ("plan", "print the fusion plans of specs")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("specs", nargs="*", help="spec files (default: [tool.fusegen] specs)")
        p.add_argument("--config", default="pyproject.toml", help="pyproject.toml holding [tool.fusegen]")
        p.add_argument("--out", help="output package folder (default: [tool.fusegen] package)")
        p.add_argument("--archs", help="comma-separated targets, e.g. sm_80,sm_90,compute_80")
        p.add_argument("--dtypes", help="comma-separated dtypes, e.g. bfloat16,float32")
        if name == "generate":
            p.add_argument("--check", action="store_true", help="exit 1 if the output package is stale")
            p.add_argument("--rebuild", action="store_true", help="recompile every kernel, reuse nothing")
    args = parser.parse_args(argv)
    try:
        return cmd_generate(args) if args.command == "generate" else cmd_plan(args)
    except SpecError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
