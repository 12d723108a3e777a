"""A package's kernels rendered: each kernel's CUDA source (its family's ``.cu.j2`` once a dtype)
and the launchers module, ``_kernels.py`` (its family's launcher template once a kernel). What
differs between families comes from the spec's KernelFamily (kernels.py); nothing here branches
on one."""

from __future__ import annotations

from .. import kernels as kn


def by_dtype(size, dtypes: tuple[str, ...]) -> str:
    """``{torch.<dtype>: size(itemsize), ...}`` as a Python dict literal (torch's dtype names)."""
    return "{" + ", ".join(f"torch.{dtype}: {size(kn.DTYPES[dtype][2])}" for dtype in dtypes) + "}"


def geometry(spec: kn.KernelSpec, dtypes: tuple[str, ...]) -> str:
    """The spec's per-dtype launch constant (KernelSpec.launch_size) as a dict literal; "" when
    the launch does not depend on the dtype."""
    if any(spec.launch_size(kn.DTYPES[dtype][2]) is None for dtype in dtypes):
        return ""
    return by_dtype(spec.launch_size, dtypes)


def few_rows(spec: kn.KernelSpec, dtypes: tuple[str, ...]) -> str:
    """The dtypes whose kernel has a ``_few_rows`` entry (KernelSpec.few_rows) as a Python tuple
    literal; "" when none has."""
    having = [f"torch.{dtype}" for dtype in dtypes if spec.few_rows(kn.DTYPES[dtype][2])]
    return f"({', '.join(having)},)" if having else ""


def cuda_source(spec: kn.KernelSpec, dtypes: tuple[str, ...], env) -> str:
    """One kernel's CUDA source: its family template instantiated for each dtype, in one
    translation unit (templates/kernel_source.cu.j2). A family template that defines a macro
    ``shared`` (the elementwise ones: the kernel's body, templated on the dtype) has it written
    once, before the dtypes' namespaces; it must render the same for every dtype."""
    dtypes = spec.kernel_family.built_dtypes(spec, dtypes)
    template = spec.kernel_family.template
    family = env.get_template(template)
    modules = {kn.DTYPES[dtype][0]: family.make_module(spec.template_context(dtype)) for dtype in dtypes}
    shared = {module.shared().strip("\n") if hasattr(module, "shared") else "" for module in modules.values()}
    if len(shared) > 1:  # the template's fault: its shared code reads something of one dtype
        raise AssertionError(f"{template}: the macro shared of {spec.name} differs between dtypes")
    bodies = [(suffix, str(module).strip("\n")) for suffix, module in modules.items()]
    return env.get_template("kernel_source.cu.j2").render(spec=spec, shared=min(shared, default=""), bodies=bodies,
                                                          template=kn.template_shown(template))


def kernel_details(spec: kn.KernelSpec, dtypes: tuple[str, ...]) -> dict:
    """A kernel's full (uncut) name, specialisation and entry points (its binaries' functions,
    by dtype) for MANIFEST.json."""
    dtypes = spec.kernel_family.built_dtypes(spec, dtypes)
    entries = {}
    for dtype in dtypes:
        suffix, _, itemsize = kn.DTYPES[dtype]
        symbol = f"{spec.name}_{suffix}"
        entries[suffix] = [symbol, *([f"{symbol}_few_rows"] if spec.few_rows(itemsize) else [])]
    return {"full_name": spec.full_name, "specialisation": spec.summary, "entries": entries}


def launcher(spec: kn.KernelSpec, op: str, dtypes: tuple[str, ...]) -> dict:
    """What templates/kernels.py.j2 and the family's launcher template read of one kernel (``k``);
    ``op``: its torch.library op's name."""
    dtypes = spec.kernel_family.built_dtypes(spec, dtypes)
    family = spec.kernel_family
    return dict(name=spec.name, op=op, family=spec.family, launcher_template=family.launcher_template, ctx=spec.ctx,
                summary=spec.summary, geometry=geometry(spec, dtypes), few_rows=few_rows(spec, dtypes),
                params=kn.kernel_abi(spec), shared=spec.shared_bytes, runtime_names=family.runtime_names(spec),
                **kn.launcher_io(spec), **family.launcher_context(spec, dtypes))


# What every launcher imports from the package's _runtime; a family adds its own (runtime_names).
RUNTIME_NAMES = ("Kernel", "register_op")


def module_head(env, launchers: list[dict]) -> list[str]:
    """The families' lines of ``_kernels.py``'s head: each registered family's head template,
    rendered with the package's ``launchers`` of that family and its module_constants, in the
    order of (head_position, registration); a family that writes nothing adds nothing."""
    entries = []
    for registered, family in enumerate(kn.FAMILIES.values()):
        if not family.head_template:
            continue
        mine = [k for k in launchers if k["family"] == family.name]
        text = env.get_template(family.head_template).render(kernels=mine, **family.module_constants).strip("\n")
        if text:
            entries.append((family.head_position, registered, text))
    return [text for _, _, text in sorted(entries)]


def fixed_sizes(specs: dict[str, kn.KernelSpec]) -> dict[str, list[kn.KernelSpec]]:
    """{size-generic kernel: the package's fixed-size kernels of the same run, by width}, as
    their families report them (KernelFamily.fixed_size_variant): a size-generic launcher
    dispatches to them (a fixed-size pipeline's kernel counts too: same ops, same constants, so
    the same computation)."""
    fixed: dict[str, list[tuple[int, kn.KernelSpec]]] = {}
    for spec in specs.values():
        variant = spec.kernel_family.fixed_size_variant(spec)
        if variant is not None and variant[0] in specs:
            fixed.setdefault(variant[0], []).append((variant[1], spec))
    return {name: [spec for _, spec in sorted(sized, key=lambda pair: pair[0])] for name, sized in fixed.items()}


def kernels_module(env, specs: dict[str, kn.KernelSpec], ops: dict[str, str], dtypes: tuple[str, ...],
                   fixed: dict[str, list[kn.KernelSpec]]) -> str:
    """The package's ``_kernels.py``: its head (the runtime's names the launchers use, the
    families' constants), then a launcher for each of ``specs`` (by name; ``ops``: their
    torch.library ops' names), then for each size-generic kernel with fixed-size ones (``fixed``:
    ``fixed_sizes``) the dict its launcher dispatches rows of their width by. A launcher template
    reads its family's module_constants (all families' are given: their names must not clash)
    and ``fixed``, those dicts' entries (width, fixed-size kernel's name) by size-generic kernel."""
    launchers = [launcher(spec, ops[name], dtypes) for name, spec in specs.items()]
    runtime_names = sorted({*RUNTIME_NAMES, *(name for k in launchers for name in k["runtime_names"])})
    constants = {key: value for family in kn.FAMILIES.values() for key, value in family.module_constants.items()}
    sizes = {name: [(spec.kernel_family.fixed_size_variant(spec)[1], spec.name) for spec in sized]
             for name, sized in fixed.items()}
    return env.get_template("kernels.py.j2").render(
        runtime_names=runtime_names, head=module_head(env, launchers), kernels=launchers, fixed=sizes, **constants)
