"""Kernel specifications: what each fused stage of a plan needs compiled.

A ``KernelSpec`` is a function of the stage alone (the stage implementations in stages/ build
them), so its name (which spells out the op chain, the feature size and any non-default
constant) is also its cache key: pipelines that share a stage share the kernel. Each spec names
its kernel family, and holds its ABI as data; ``context`` fills the family's templates.

A ``KernelFamily`` is everything that differs between families: its ``.cu`` template and its
launcher template, its launch geometry and entry points, its shared memory, its launcher's
arguments and its lines of ``_kernels.py``'s head (constants, imports from ``_runtime``). Each
family's folder (stages/<family>/) registers its own (``register_family``); a plugin may register
more (plugins.register_family). Nothing here branches on a family's name.

Names are bounded (``kernel_name``): one longer than ``MAX_KERNEL_NAME`` keeps a readable prefix
of its op chain, then ``x`` + a short hash of the full name, then its direction and size, so a
long elementwise run cannot push ``kernels/<name>.<arch>.cubin`` past file-name limits.
The full name is kept in ``KernelSpec.full_name`` (the .cu header comment and MANIFEST.json).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

DTYPES = {"bfloat16": ("bf16", "__nv_bfloat16", 2), "float16": ("fp16", "__half", 2), "float32": ("fp32", "float", 4)}
# Longest kernel name. Every name of the shipped specs but the long elementwise_chain run fits;
# a file name ("<name>.compute_80.ptx") and a function's ("<name>_bf16_few_rows") stay under 64 bytes.
MAX_KERNEL_NAME = 48
NAME_HASH_CHARS = 8  # hex digits of sha256(full name) in a cut name: "x" + 8 hex


def kernel_name(chain: str, suffix: str, qualifier: str = "") -> tuple[str, str]:
    """(name, full name) of a kernel: ``<chain>_<suffix>[_<qualifier>]``, bounded.

    ``chain`` spells what the kernel computes (op tags, e.g. "bias_scale0p5_gelu"), ``suffix`` its
    direction and size ("fwd_n384", "bwd_h768", "n1024"), ``qualifier`` a variant ("from_bias",
    "add_dresidual"). A full name of at most MAX_KERNEL_NAME characters is the name. A longer one
    becomes ``<prefix>_x<hash>_<suffix>[_<qualifier>]``: the longest prefix of ``chain`` ending at
    a ``_`` that fits, then the first NAME_HASH_CHARS hex digits of sha256(full name), so the name
    is stable and (up to the hash) unique; the qualifier is dropped when even an empty prefix
    leaves no room for it (the hash still covers it)."""
    full = "_".join(part for part in (chain, suffix, qualifier) if part)
    if len(full) <= MAX_KERNEL_NAME:
        return full, full
    marker = "x" + hashlib.sha256(full.encode()).hexdigest()[:NAME_HASH_CHARS]
    tail = "_".join(part for part in (marker, suffix, qualifier) if part)
    if len(tail) > MAX_KERNEL_NAME:
        tail = f"{marker}_{suffix}"
    assert len(tail) <= MAX_KERNEL_NAME, f"kernel suffix {suffix!r} is too long for a bounded name"
    prefix = ""
    for part in chain.split("_"):
        longer = f"{prefix}_{part}" if prefix else part
        if len(longer) + 1 + len(tail) > MAX_KERNEL_NAME:
            break
        prefix = longer
    return (f"{prefix}_{tail}" if prefix else tail), full


class KernelFamily:
    """How the kernels of one family (``KernelSpec.family``) are instantiated and launched.

    A family's folder (stages/<family>/) defines one subclass per family name it builds and
    registers an instance (``register_family``); a plugin registers its own the same way
    (plugins.register_family). Templates are named by their path under a template folder, whose
    first part is the family's folder ("norm/norm_fwd.cu.j2"): fusegen's templates/<folder>/, or a
    plugin's folder of that name. The defaults suit a kernel with a fixed launch shape."""

    name = ""  # the KernelSpec.family it answers for, e.g. "norm_fwd"
    template = ""  # its .cu.j2, instantiated once a dtype (templates/kernel_source.cu.j2 wraps them)
    launcher_template = ""  # its section of the package's _kernels.py (templates/kernels.py.j2 includes it)
    sums_partials = False  # True: it sums another kernel's fp32 partials, the second launch of a backward
    # Its lines of _kernels.py's head (module constants its launchers read): a template of its
    # folder, rendered once a package for every registered family, given ``kernels`` (the
    # package's launchers of this family, maybe none) and its module_constants; "": none.
    head_template = ""
    # Where its head lines go: the head holds the families' lines sorted by head_position, a tie
    # in registration order. fusegen's families take 10 to 40 (the order the head always had:
    # elementwise_fwd, norm_bwd, elementwise_bwd, column_sum), so a plugin's go after them.
    head_position = 100
    # values its head template and launcher template read: {template variable: value}
    module_constants: dict[str, object] = {}

    def built_dtypes(self, spec: KernelSpec, dtypes: tuple[str, ...]) -> tuple[str, ...]:
        """The dtypes ``spec``'s kernel has functions for: the package's (its ``T``, the
        activations'), unless it reads none of them."""
        return dtypes

    def launch_size(self, spec: KernelSpec, itemsize: int) -> int | None:
        """The dtype-dependent launch constant of ``spec`` (its launcher's ``geometry`` literal);
        None when its launch does not depend on the dtype."""
        return None

    def few_rows(self, spec: KernelSpec, itemsize: int) -> bool:
        """Whether ``spec``'s kernel of that dtype has a second entry point, ``<symbol>_few_rows``,
        for a grid of at most one wave of blocks (the runtime's Kernel.launch picks it)."""
        return False

    def shared_bytes(self, spec: KernelSpec) -> int:
        """Dynamic shared memory a block needs (Kernel(shared=...) opts in above 48 KB)."""
        return 0

    def sums_itself_up_to(self, spec: KernelSpec) -> int | None:
        """The rows up to which a backward adds its parameter grads itself, in its one launch
        (above them a ``sums_partials`` kernel does); None: never."""
        return None

    def template_context(self, spec: KernelSpec, dtype: str, itemsize: int) -> dict:
        """What its ``.cu`` template reads for one dtype beyond KernelSpec.template_context's."""
        return {}

    def launcher_io(self, spec: KernelSpec) -> dict:
        """Its launcher's ``args`` (the whole argument list, in order) and ``outputs`` (how many
        tensors it returns), and where they apply: ``written``, the results besides ``y`` its
        kernel writes; ``random``, the operands passed as ``pointer(t)`` (a Dropout's key, None in
        eval mode); ``types``, the custom op's schema type of an argument that is no ``Tensor``
        (e.g. ``{"dtype": "ScalarType"}``). The launcher's def and its custom op's schema under
        torch.compile both come from these (``launcher_io``)."""
        raise NotImplementedError(f"kernel family {self.name}: launcher_io")

    def runtime_names(self, spec: KernelSpec) -> tuple[str, ...]:
        """What its launcher imports from the package's ``_runtime`` besides ``Kernel`` and
        ``register_op`` (every launcher's): ``pointer`` where it passes random operands (the
        launch tuple, kernels.py.j2's abi_args, writes ``pointer(t)`` for them)."""
        return ("pointer",) if launcher_io(spec)["random"] else ()

    def launcher_context(self, spec: KernelSpec, dtypes: tuple[str, ...]) -> dict:
        """Whatever else its launcher template reads (``k.<key>``), for the package's dtypes."""
        return {}

    def fixed_size_variant(self, spec: KernelSpec) -> tuple[str, int] | None:
        """Where ``spec`` is a fixed-size kernel of a run that a size-generic kernel also computes:
        that kernel's name and the width ``spec`` was built for. The size-generic launcher hands
        rows of that width to it when they start on 16-byte boundaries (``_kernels.py``'s
        ``aligned`` and ``_<NAME>_FIXED``, stages/launchers.fixed_sizes). None: it is none (the
        default: a family without fixed-size variants)."""
        return None


FAMILIES: dict[str, KernelFamily] = {}  # by KernelSpec.family: fusegen's, then a build's plugins'


def constant_owner(name: str) -> str | None:
    """The registered family whose module_constants hold ``name``; None: no family's."""
    return next((family.name for family in FAMILIES.values() if name in family.module_constants), None)


def register_family(family: KernelFamily) -> KernelFamily:
    """Make ``family`` the one that answers for specs of ``family.name``; a name is taken once, and
    so is a module constant's (the launcher templates read every family's by name)."""
    if not family.name or family.name in FAMILIES:
        raise ValueError(f"kernel family {family.name!r} is {'already registered' if family.name else 'unnamed'}; "
                         "give the family a name of its own")
    for constant in family.module_constants:
        if constant_owner(constant) is not None:
            raise ValueError(f"kernel family {family.name!r}: its module constant {constant!r} is kernel family "
                             f"{constant_owner(constant)!r}'s; give the constant a name of its own")
    FAMILIES[family.name] = family
    return family


def family_of(spec: KernelSpec) -> KernelFamily:
    family = FAMILIES.get(spec.family)
    assert family is not None, f"kernel {spec.name}: no kernel family {spec.family!r} is registered"
    return family


@dataclass(frozen=True)
class TemplateFolder:
    """A plugin's template folder: its files are named ``<folder name>/<file>``, as fusegen's own
    family folders' are; ``shown`` is how a generated source names it (a path in the project)."""

    path: Path
    shown: str


# A build's plugins' template folders by name (plugins.register_family); the jinja environment's
# loader looks here for a template fusegen's own folder does not hold (plugin_template).
PLUGIN_TEMPLATES: dict[str, TemplateFolder] = {}


def plugin_template(name: str) -> tuple[str, str, Callable[[], bool]] | None:
    """The (source, file, uptodate) of a plugin's template ``<folder>/<file>``; None when no
    plugin folder of the build holds it (jinja then reports it missing). ``uptodate`` turns False
    once the folder is another build's, or the file changed, so no build reuses another's."""
    folder_name, _, rest = name.partition("/")
    folder = PLUGIN_TEMPLATES.get(folder_name)
    path = folder.path / rest if folder is not None and rest else None
    if path is None or not path.is_file():
        return None
    mtime = path.stat().st_mtime_ns
    return (path.read_text(), str(path),
            lambda: PLUGIN_TEMPLATES.get(folder_name) == folder and path.is_file() and path.stat().st_mtime_ns == mtime)


def template_shown(name: str) -> str:
    """How a generated source names the template ``name`` it came from."""
    folder_name, _, rest = name.partition("/")
    folder = PLUGIN_TEMPLATES.get(folder_name)
    return f"{folder.shown}/{rest}" if folder is not None else f"templates/{name}"


@dataclass(frozen=True)
class KernelParam:
    """One parameter of a kernel's C ABI. The ``.cu`` signature (templates/kernel_abi.j2) and the
    Python launch tuple (templates/kernels.py.j2) are both rendered from a spec's ``params``."""

    name: str  # the .cu parameter, and the launcher's local variable that holds it
    ctype: str  # "const T*", "T*", "const float*", "float*" or "int" (T: the kernel's dtype)
    passed: bool = True  # False: this specialisation passes a null pointer, which the kernel ignores

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its name, the kernel family that instantiates and launches it, and its ABI as data.

    ``params`` is the C signature in order; ``operands`` are the launcher's tensor arguments after
    its first (x or dy), ``returned`` what the launcher returns. Stage implementations build specs
    (stages/); templates and emit only read them."""

    name: str  # e.g. "bias_swiglu_bwd_n14336" (its functions add the dtype suffix); bounded (kernel_name)
    full_name: str  # the name before bounding; equal to ``name`` unless that was cut
    family: str  # its KernelFamily's name (FAMILIES): norm_fwd | norm_bwd | column_sum | elementwise_fwd | ...
    context: tuple[tuple[str, object], ...]  # template variables, hashable and ordered
    summary: str
    params: tuple[KernelParam, ...] = ()
    operands: tuple[str, ...] = ()
    returned: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()  # the device headers its source includes, in order
    # How the launch shape follows from the row, as its family reads it (KernelFamily.launch_size):
    # "row_threads" (a block per row, threads covering the row's vectors: norms), "row_vectors"
    # (grid x covering the row's vectors with ``threads`` per block: elementwise),
    # "any_row_vectors" (the same for a size-generic kernel: the launcher computes grid x from the
    # run-time n and the vector width) or "" (fixed: column sums).
    geometry: str = ""

    @property
    def kernel_family(self) -> KernelFamily:
        """The family that instantiates and launches it (FAMILIES)."""
        return family_of(self)

    @property
    def ctx(self) -> dict:
        ctx = dict(self.context)
        for ops in ("steps", "prologue", "epilogue"):  # elementwise ops, as (key, value) pairs
            if ops in ctx:
                ctx[ops] = [dict(step) for step in ctx[ops]]
        return ctx

    @property
    def uses_math(self) -> bool:
        """Whether a functor of its ops takes the kernel's precision of exp and division
        (``Math`` in its device_struct: fg::Gelu<Math>, common.cuh)."""
        return any(re.search(r"\bMath\b", step["struct"] or "") for step in self.ctx.get("steps", ())
                   if step.get("uses_functor", True))  # a backward builds only the functors it calls

    def vec(self, itemsize: int) -> int:
        """Widest vector (at most 16 bytes) that divides every row this kernel touches."""
        v = 16 // itemsize
        while self.ctx["align"] is not None and self.ctx["align"] % v:  # None: size-generic, any n
            v //= 2
        return v

    def launch_size(self, itemsize: int) -> int | None:
        """The dtype-dependent launch constant: threads per block ("row_threads"), blocks along
        the row ("row_vectors") or elements per vector ("any_row_vectors"); None when the launch
        does not depend on the dtype (KernelFamily.launch_size)."""
        return self.kernel_family.launch_size(self, itemsize)

    def few_rows(self, itemsize: int) -> bool:
        """Whether this kernel has a ``_few_rows`` entry point (KernelFamily.few_rows)."""
        return self.kernel_family.few_rows(self, itemsize)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory a block of this kernel needs (KernelFamily.shared_bytes)."""
        return self.kernel_family.shared_bytes(self)

    def template_context(self, dtype: str) -> dict:
        """Everything the ``.cu`` template of one dtype reads: the spec's context, its ABI, the
        dtype's type, vector width and precision of exp and division, and what its family adds
        (per-row kernels: threads). The template renders that dtype's namespace of the kernel's
        source (templates/kernel_source.cu.j2)."""
        suffix, ctype, itemsize = DTYPES[dtype]
        ctx = self.ctx
        ctx.update(kernel_name=f"{self.name}_{suffix}", ctype=ctype, vec=self.vec(itemsize),
                   math=("FastMath" if itemsize < 4 else "ExactMath") if self.uses_math else None,
                   params=self.params, operands=self.operands)
        ctx.update(self.kernel_family.template_context(self, dtype, itemsize))
        return ctx


def sums_itself_up_to(spec: KernelSpec) -> int | None:
    """The rows up to which a backward adds its parameter grads itself, in its one launch (a norm
    backward's cooperative launch, an elementwise backward's column-tiled one); None: never."""
    return spec.kernel_family.sums_itself_up_to(spec)


def kernel_abi(spec: KernelSpec) -> tuple[KernelParam, ...]:
    """The parameters of ``spec``'s kernel, in order: the one source of its ABI."""
    return spec.params


def launcher_io(spec: KernelSpec) -> dict:
    """A launcher's tensor operands (after x or dy) and results; ``written``: the results besides
    ``y`` that the kernel writes (an elementwise forward's extra outputs); ``random``: the operands
    passed as pointers that may be null; ``args``: its whole argument list and ``outputs``: how
    many tensors it returns (KernelFamily.launcher_io); ``schema``: each argument with its custom
    op's type, a ``Tensor`` unless ``types`` says otherwise, a ``Tensor?`` where it is random."""
    io = {"operands": list(spec.operands), "returned": list(spec.returned), "written": [], "random": [],
          "types": {}, **spec.kernel_family.launcher_io(spec)}
    types = {**{name: "Tensor?" for name in io["random"]}, **io["types"]}
    io["schema"] = [f"{types.get(arg, 'Tensor')} {arg}" for arg in io["args"]]
    return io


def make_spec(name: tuple[str, str], family: str, summary: str, abi: Sequence[KernelParam] = (),
              operands: Sequence[str] = (), returned: Sequence[str] = (), headers: Sequence[str] = (),
              geometry: str = "", **context) -> KernelSpec:
    """A spec named by ``kernel_name``'s (name, full name); ``context`` fills its templates."""
    return KernelSpec(*name, family, tuple(sorted(context.items())), summary, tuple(abi), tuple(operands),
                      tuple(returned), tuple(headers), geometry)
