"""The whole compile: spec files → pipelines → plans → files of the output package.

``build_package`` returns the complete output set as {relative path: bytes}, MANIFEST.json
included (it lists every file, which is what fusegen owns in the output folder; see output.py for
how it is written). The kernels' sources are compiled by the toolchain (toolchain/), which reuses
the existing package's binaries whose sources, headers and compiler options have not changed.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Callable, Iterable, Sequence

from . import emit, ops, plugins, stages
from . import kernels as kn
from .config import Config, Fp8Build
from .errors import SpecError, UsageError
from .frontend import SequentialSpec, parse_spec_file
from .names import NameTable, class_name
from .ops.identity import quantize_points
from .output import MANIFEST, manifest_bytes
from .pipeline import Pipeline, build_pipeline
from .plan import Plan, Rule, plan_pipeline
from .progress import Progress
from .stages.launchers import cuda_source, fixed_sizes, kernel_details, kernels_module
from .toolchain import binary_name, compile_kernels, header_files, included_headers, sha256
from .wrap import wrap_python


def display(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.name


def plan_specs(specs: Iterable[SequentialSpec], names: NameTable, forward_rules: Sequence[Rule],
               backward_rules: Sequence[Rule], features: dict[str, tuple[int, ...]] | None = None,
               config: Config | None = None) -> list[Plan]:
    """Pipelines and plans for parsed specs, each name claimed in ``names`` (one table per build,
    so names collide across files too). The whole path from a parsed file to its plans.
    ``features``: input sizes to specialise size-generic pipelines for, by name; ``config``: the
    build's settings, which say which pipelines are built for FP8 (with_fp8)."""
    plans = []
    for spec in specs:
        names.claim(spec.name, spec.name_location)
        # the sizes the pipeline's table gives, else the one its TE modules' tp_size fixes, else 1; several
        # sizes are a pipeline each, "<name>_tp<size>" (the package's <Name> chooses by the group's size)
        sizes = dict(config.tensor_parallel).get(spec.name, (None,)) if config is not None else (None,)
        for size in sizes:
            variant = spec
            if len(sizes) > 1:
                variant = dataclasses.replace(spec, name=f"{spec.name}_tp{size}")
                names.claim(variant.name, spec.name_location)
            pipeline = build_pipeline(variant, (features or {}).get(spec.name, ()), size)
            if len(sizes) > 1:
                pipeline = dataclasses.replace(pipeline, variant_of=spec.name)
            if config is not None:
                pipeline = with_fp8(pipeline, config)
                check_tensor_parallel(pipeline, config)
            plans.append(plan_pipeline(pipeline, forward_rules, backward_rules))
    return plans


def with_fp8(pipeline: Pipeline, config: Config) -> Pipeline:
    """The pipeline with the FP8 recipes it is built for: its own table's ``fp8``, else
    [tool.fusegen] fp8 where it has a GEMM. The GEMMs' sizes must suit FP8 GEMMs (multiples of 16,
    TE's rule), and its Quantize ops sit where they cast a GEMM's operand or at its ends."""
    own = dict(config.pipeline_fp8).get(pipeline.table_name)
    recipes = own if own is not None else config.fp8
    gemms = stages.gemm.gemm_ops(pipeline)
    if not recipes or (own is None and not gemms):
        return pipeline
    where = f"{config.source}: [tool.fusegen.pipelines.{pipeline.name}] fp8"
    if not gemms:
        raise UsageError(f"{where}: pipeline '{pipeline.name}' ({pipeline.location}) has no Linear, so nothing of it "
                         "runs in FP8; remove the setting")
    for op in gemms:
        for size, what in ((op.in_features, "in_features"), (op.out_features, "out_features")):
            if isinstance(size, int) and size % 16:
                raise SpecError(f"{op.describe()}: {what}={size} is not a multiple of 16, which FP8 GEMMs need "
                                f"(TE's rule); pipeline '{pipeline.name}' is built for FP8 ([tool.fusegen] fp8): give "
                                "it sizes that are multiples of 16, or fp8 = [] in its "
                                f"[tool.fusegen.pipelines.{pipeline.name}] table", op.location)
            if "block" in recipes and isinstance(size, int) and size % 128:
                raise SpecError(f"{op.describe()}: {what}={size} is not a multiple of 128, which Float8BlockScaling's "
                                "1x128 and 128x128 blocks need (torch._scaled_mm's block-scaled GEMMs); pipeline "
                                f"'{pipeline.name}' is built for it (\"block\" in fp8): give it sizes that are "
                                "multiples of 128, or leave \"block\" out of fp8 in its "
                                f"[tool.fusegen.pipelines.{pipeline.name}] table", op.location)
    user_modules = any(op.opdef.user_module for op in pipeline.ops)
    for node, mode, neighbour in quantize_points(pipeline.graph):
        if neighbour is None and user_modules:
            raise SpecError(f"Quantize({mode}=True) at the {'end' if mode == 'forward' else 'start'} of pipeline "
                            f"'{pipeline.name}', built for FP8 ([tool.fusegen] fp8), which runs a module of your "
                            "code: the FP8 round trip there is not generated yet for such pipelines; leave it out, "
                            f"or fp8 = [] in its [tool.fusegen.pipelines.{pipeline.name}] table", node.location)
        if neighbour is not None and neighbour.opdef.kind != "linear":
            there = neighbour.opdef.name + (f" (of {neighbour.module_call})"
                                            if not neighbour.module_call.startswith(neighbour.opdef.name) else "")
            raise SpecError(f"Quantize({mode}=True) in pipeline '{pipeline.name}', built for FP8 ([tool.fusegen] fp8), "
                            f"is generated where it casts a Linear's {'input' if mode == 'forward' else 'output grad'} "
                            f"(TE's use: the Linear {'right after' if mode == 'forward' else 'right before'} it takes "
                            f"the FP8 tensor) or at the pipeline's {'end' if mode == 'forward' else 'start'}; the op "
                            f"{'after' if mode == 'forward' else 'before'} it is {there}: put it next to a Linear, or "
                            "leave it out (each Linear casts its own operands)", node.location)
    return dataclasses.replace(pipeline, fp8=Fp8Build(recipes, config.fp8_min_rows))


def check_tensor_parallel(pipeline: Pipeline, config: Config) -> None:
    """A pipeline built for a tensor-parallel size above 1 splits something over the group, and
    is not built for FP8 as well (not generated yet)."""
    if pipeline.tensor_parallel == 1:
        return
    where = f"{config.source}: [tool.fusegen.pipelines.{pipeline.table_name}] tensor_parallel_size"
    if pipeline.group is None:
        raise UsageError(f"{where}: pipeline '{pipeline.name}' ({pipeline.location}) has no op that splits over a "
                         "tensor-parallel group (a Linear with tensor_parallel_mode, AllGather, ReduceScatter, "
                         "AllReduce); remove the setting")
    if pipeline.fp8 is not None:
        raise UsageError(f"{where}: pipeline '{pipeline.name}' is built for FP8 too, and FP8 GEMMs between "
                         "tensor-parallel collectives are not generated yet; build it with fp8 = [] in its "
                         f"[tool.fusegen.pipelines.{pipeline.table_name}] table, or tensor_parallel_size = 1")


def check_features(config: Config, plans: list[Plan]) -> None:
    """Each [tool.fusegen.pipelines.<name>] names a size-generic pipeline of the specs, and its
    sizes are ones the pipeline accepts. Spec files named on the command line may be a part of
    the project's: a table naming a pipeline they do not hold is then for another file."""
    where = f"{config.source}: [tool.fusegen.pipelines"
    pipelines = {plan.pipeline.table_name: plan.pipeline for plan in plans}
    named = {name for name, _ in config.features} | {name for name, _ in config.pipeline_fp8}
    for name in sorted(named | {name for name, _ in config.tensor_parallel}):
        if name not in pipelines and not config.specs_named_on_command_line:
            close = difflib.get_close_matches(name, pipelines, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"pipelines: {', '.join(sorted(pipelines))}"
            raise UsageError(f"{where}.{name}] names no pipeline of the specs; {hint}")
    for name, sizes in config.features:
        pipeline = pipelines.get(name)
        if pipeline is None and config.specs_named_on_command_line:
            continue
        if pipeline is None:
            close = difflib.get_close_matches(name, pipelines, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"pipelines: {', '.join(sorted(pipelines))}"
            raise UsageError(f"{where}.{name}] names no pipeline of the specs; {hint}")
        if not pipeline.generic:
            raise UsageError(f"{where}.{name}] features: pipeline '{name}' ({pipeline.location}) has a fixed "
                             f"input size, {pipeline.in_features}; features is for pipelines in which no op "
                             "fixes the size. Remove the table")
        odd = [n for n in sizes if n % pipeline.divisor]
        if odd:
            raise UsageError(f"{where}.{name}] features: {odd[0]} is not a multiple of {pipeline.divisor}, "
                             f"which pipeline '{name}' needs (each GLU halves the size); give sizes it accepts")


def load_plans(config: Config) -> list[Plan]:
    """The plans of the config's specs, with its plugins loaded while planning."""
    with plugins.loaded(config.plugins, config.root) as ext:
        return plans_with(config, ext)


def plans_with(config: Config, ext: plugins.Extensions) -> list[Plan]:
    plans: list[Plan] = []
    names = NameTable()  # pipeline names become module and class names of one package
    features = dict(config.features)
    for path in config.specs:
        specs = parse_spec_file(path, display(path, config.root))
        plans.extend(plan_specs(specs, names, ext.forward_rules, ext.backward_rules, features, config))
    check_features(config, plans)
    return plans


def collect_kernels(plans: list[Plan]) -> tuple[dict[str, kn.KernelSpec], dict[str, dict]]:
    """Unique kernels by name (a name fixes the source), and each plan's stage → kernels map."""
    unique: dict[str, kn.KernelSpec] = {}
    per_plan = {}
    for plan in plans:
        stage_kernels = stages.stage_kernels(plan)
        per_plan[plan.pipeline.name] = stage_kernels
        for specs in stage_kernels.values():
            for spec in specs:
                if unique.setdefault(spec.name, spec) != spec:
                    raise AssertionError(f"two different kernels are both named {spec.name}")
    return dict(sorted(unique.items())), per_plan


def op_name(spec: kn.KernelSpec, sources: dict[str, str]) -> str:
    """The torch.library op of one kernel's launcher (in the "fusegen" namespace): its name and a
    digest of its CUDA source, so packages that hold the same kernel share its op, a kernel that
    changes gets a new one (two packages never register different kernels under one name), and
    a change to one kernel changes no other launcher's lines."""
    return f"{spec.name}_{sha256(sources[spec.name].encode())[:8]}"


def plan_documents(config: Config) -> dict[str, str]:
    """{pipeline: its plan.md text}, without compiling anything (`fusegen plan`)."""
    with plugins.loaded(config.plugins, config.root) as ext:
        plans = plans_with(config, ext)
        _, per_plan = collect_kernels(plans)
        env = emit.environment()
        return {plan.pipeline.name: env.get_template("plan.md.j2").render(
            **emit.pipeline_context(plan, per_plan[plan.pipeline.name])) for plan in plans}


def build_package(config: Config, progress: Progress | None = None, reuse: bool = True,
                  before_compiling: Callable[[set[str]], None] | None = None) -> dict[str, bytes]:
    """The complete output set; ``reuse`` lets matching binaries of the existing package stand.
    ``before_compiling`` is given the names of every file of the set before the first compile (the
    CLI refuses there to overwrite a file fusegen did not write, not minutes later)."""
    with plugins.loaded(config.plugins, config.root) as ext:
        return _build(config, ext, progress or Progress(), reuse, before_compiling)


def _build(config: Config, ext: plugins.Extensions, progress: Progress, reuse: bool,
           before_compiling: Callable[[set[str]], None] | None) -> dict[str, bytes]:
    plans = plans_with(config, ext)
    unique, per_plan = collect_kernels(plans)
    headers = header_files(ext.headers)
    env = emit.environment()
    files: dict[str, str | bytes] = {}
    sources = {name: cuda_source(spec, config.dtypes, env) for name, spec in unique.items()}
    details = {name: kernel_details(spec, config.dtypes) for name, spec in unique.items()}
    for name, source in sources.items():
        files[f"kernels/{name}.cu"] = source
    shipped = {name for source in sources.values() for name in included_headers(source, "", headers)}
    for name, path in headers.items():  # shipped so the sources rebuild as they stand
        if name not in ext.headers or name in shipped:
            files[f"kernels/{name}"] = path.read_text()
    op_names = {name: op_name(spec, sources) for name, spec in unique.items()}
    files["_kernels.py"] = kernels_module(env, unique, op_names, config.dtypes, fixed_sizes(unique))
    for module in sorted((emit.TEMPLATES / "runtime").glob("*.py")):  # the runtime, a package of modules
        files[f"_runtime/{module.name}"] = module.read_text()
    files["_reference.py"] = ops.reference_source()  # the ops' reference math, copied by source
    for plan in plans:
        ctx = emit.pipeline_context(plan, per_plan[plan.pipeline.name])
        files[f"{plan.pipeline.name}.py"] = env.get_template("pipeline.py.j2").render(**ctx)
        files[f"{plan.pipeline.name}.plan.md"] = env.get_template("plan.md.j2").render(**ctx)
    variants: dict[str, list[Pipeline]] = {}  # a pipeline built for several tensor-parallel sizes: one a size
    for plan in plans:
        if plan.pipeline.variant_of:
            variants.setdefault(plan.pipeline.variant_of, []).append(plan.pipeline)
    for name, pipelines in variants.items():  # its module choosing among them by the group's size
        files[f"{name}.py"] = env.get_template("tensor_parallel_sizes.py.j2").render(
            name=name, file=pipelines[0].file, class_name=class_name(name),
            variants=[(p.tensor_parallel, p.class_name) for p in pipelines])
    files["__init__.py"] = env.get_template("package_init.py.j2").render(
        pipelines=[p.pipeline for p in plans], chosen=[(name, class_name(name)) for name in variants],
        dtypes=config.dtypes, archs=config.archs)
    if before_compiling is not None:
        before_compiling({*files, *(binary_name(kernel, target) for kernel in sources for target in config.archs),
                          MANIFEST})
    previous = config.out if reuse and config.out.is_dir() else None
    binaries, manifest = compile_kernels(sources, config.archs, previous, progress, headers)
    for name, entry in manifest.items():
        entry.update(details[name])
    files.update(binaries)
    files[MANIFEST] = manifest_bytes({
        "generator": "fusegen", "archs": list(config.archs), "dtypes": list(config.dtypes),
        "kernels": manifest, "files": sorted(files),
    })
    for name, text in files.items():  # every Python file at most 100 columns wide
        if name.endswith(".py"):
            files[name] = wrap_python(text)
    return {k: v.encode() if isinstance(v, str) else v for k, v in sorted(files.items())}
