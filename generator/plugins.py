"""Plugins: modules of the user's own repository that add ops, fusion rules and kernel families.

``[tool.fusegen] plugins = ["mypkg.fusegen_ext"]`` names modules that fusegen imports (with the
project folder, where the pyproject.toml is, first on ``sys.path``) before it reads any spec. At
import they call ``register_op`` and ``register_rule``; what they register lasts for that one
build (``loaded``), so two builds in one process never see each other's plugins; imported by
anything else (a test, a notebook), the module imports as any other: its ops join the registry
for that process, never a build, and its rules no list. As with TE's
``BasicOperation`` and ``register_forward_fusion``, nothing of fusegen is forked:

    from fusegen.plugins import FORWARD, NORM, OpDef, Operand, Param, Rule, register_op, register_rule

    def learnable_scale(x, scale):                 # reference math, shipped into _reference.py
        return x * scale
    ...
    LearnableScale = register_op(OpDef("LearnableScale", "learnable_scale", ..., device_struct="ext::Mul",
                                       device_header="learnable_scale.cuh"), cuda="cuda")
    register_rule(Rule("learnable_scale_norm", FORWARD, NORM, "...", pattern=("learnable_scale", "norm")),
                  before="norm")

An op's reference functions follow the registry's rules (ops/shipped.py: they may read only
``torch``, ``math``, the common helpers and their own helpers; ``torch`` is this module's lazy
one, so a plugin never imports torch into the compiler). Its device functor lives in a ``.cuh``
of the plugin's ``cuda`` folder, which kernels include by name and the build cache digests.
A rule is checked against its stage implementation when it is made (plan.Rule).

A whole kernel family takes three things: a stage implementation (a ``StageImpl`` whose
``kernels`` builds ``KernelSpec``s of the family, named in the plugin's rules), a ``KernelFamily``
per family name (its templates, launch geometry and launcher's arguments; kernels.py), and a
template folder holding the family's ``.cu.j2`` and launcher ``.py.j2`` templates and its ``.cuh``
headers: ``register_family(family, templates="row_softmax")``. Its templates are named
``<folder name>/<file>``, as fusegen's own families' are (templates/norm/norm_fwd.cu.j2), so the
folder's name must be one of its own. tests/fixtures/family_project is the example.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from . import fusion_rules
from . import kernels as kn
from .calls import Launch, TorchCall
from .errors import UsageError
from .emit import TEMPLATES
from .kernels import KernelFamily, KernelParam, kernel_name, make_spec
from .ops import OPS, SPEC_MODULES, Arg, OpDef, Operand, Param, register
from .ops.lazy import torch
from .plan import BACKWARD, FORWARD, Rule, RuleError
from .stages import ELEMENTWISE, GEMM, NORM, Saves, StageImpl
from .stages.base import RowTraffic

BUILTIN_HEADERS = TEMPLATES / "cuda"


@dataclass
class Extensions:
    """What the plugins of one build added: the rule lists in force and their device headers."""

    forward_rules: list[Rule] = field(default_factory=lambda: list(fusion_rules.FORWARD_RULES))
    backward_rules: list[Rule] = field(default_factory=lambda: list(fusion_rules.BACKWARD_RULES))
    headers: dict[str, Path] = field(default_factory=dict)  # header name -> file, plugins' only
    loading: str = ""  # the plugin module being imported
    root: Path = Path()  # the project folder


_active: Extensions | None = None


# Ops of plugin modules imported outside a build (a test, a notebook): in the registry for the
# process, as importing a library defines its names (so the module's rules over them can be made),
# but never in a build, which imports its plugins afresh (``loaded``).
_outside_builds: dict[str, OpDef] = {}


def _current() -> Extensions | None:
    """The build importing a plugin now; None when the module is imported by anything else."""
    return _active if _active is not None and _active.loading else None


def register_op(op: OpDef, cuda: str | Path | None = None) -> OpDef:
    """Add a plugin's op to the registry for this build.

    ``cuda``: the folder holding the op's ``device_header`` (relative to the plugin module's
    file, or absolute); needed when the op's functor is the plugin's own (one of fusegen's
    headers, say activations.cuh for fg::Scale, needs none). A spec imports the op from the
    module that registers it, unless ``op.modules`` names others. Returns the op. Outside a
    build the op is registered for the process only (``_outside_builds``), and importing the
    module again replaces it."""
    ext = _current()
    if ext is None:
        if op.name in _outside_builds:
            del OPS[op.name]
        _outside_builds[op.name] = register(op)
        return op
    module = sys.modules.get(ext.loading)
    if op.modules == SPEC_MODULES:  # not said: the spec imports it from the plugin module
        op = replace(op, modules=(ext.loading,))
    builtin = (BUILTIN_HEADERS / op.device_header).is_file()
    if op.device_struct and not (cuda is None and builtin):  # a builtin header needs no folder
        if cuda is None:
            raise RuleError(f"op {op.name}: its functor {op.device_struct} needs the folder of "
                            f"{op.device_header}: register_op(..., cuda=\"cuda\")")
        folder = Path(cuda)
        if not folder.is_absolute() and module is not None and getattr(module, "__file__", None):
            folder = Path(module.__file__).resolve().parent / folder
        header = folder / op.device_header
        if not header.is_file():
            raise RuleError(f"op {op.name}: device header {op.device_header} not found in {folder}")
        known = ext.headers.get(op.device_header)
        if builtin or (known is not None and known != header):
            raise RuleError(f"op {op.name}: a device header named {op.device_header} already exists; "
                            "give the plugin's header a name of its own")
        ext.headers[op.device_header] = header
    return register(op)


def register_rule(rule: Rule, *, before: str | None = None, after: str | None = None) -> Rule:
    """Put a plugin's rule into its pass's ordered rule list for this build: just before or after
    the rule named ``before``/``after``, or last (after every shipped rule) when neither is given.
    Returns the rule; outside a build, puts it in no list (rules are for builds only)."""
    ext = _current()
    if ext is None:
        return rule
    rules = ext.forward_rules if rule.pass_ == FORWARD else ext.backward_rules
    if before is not None and after is not None:
        raise RuleError(f"fusion rule '{rule.name}': give before= or after=, not both")
    if any(r.name == rule.name for r in rules):
        raise RuleError(f"fusion rule '{rule.name}' is already in the {rule.pass_} rules; give it another name")
    anchor = before if before is not None else after
    if anchor is None:
        rules.append(rule)
        return rule
    names = [r.name for r in rules]
    if anchor not in names:
        raise RuleError(f"fusion rule '{rule.name}': no {rule.pass_} rule is named '{anchor}'; the {rule.pass_} "
                        f"rules are {', '.join(names)}")
    rules.insert(names.index(anchor) + (after is not None), rule)
    return rule


def register_family(family: KernelFamily, templates: str | Path) -> KernelFamily:
    """Add a plugin's kernel family for this build: ``family`` answers for the specs whose
    ``family`` is ``family.name``, and ``templates`` (relative to the plugin module's file, or
    absolute) is the folder of its templates and ``.cuh`` headers. ``family.template`` and
    ``family.launcher_template`` (and a ``head_template``) are named ``<folder name>/<file>``; the headers are included by
    file name (and digested by the build cache) like fusegen's own. Two families may share one
    folder. Returns the family; outside a build registers nothing (families are for builds only)."""
    ext = _current()
    if ext is None:
        return family
    where = f"kernel family {family.name!r}"
    if not family.name:
        raise RuleError("a kernel family needs a name (KernelFamily.name), the family its KernelSpecs name")
    if family.name in kn.FAMILIES:
        raise RuleError(f"{where} already exists; give the family a name of its own")
    folder = _plugin_path(templates, ext)
    if not folder.is_dir():
        raise RuleError(f"{where}: its template folder {folder} is not a folder")
    known = kn.PLUGIN_TEMPLATES.get(folder.name)
    if (TEMPLATES / folder.name).exists() or (known is not None and known.path != folder):
        owner = "in fusegen's templates/" if known is None else f"{known.shown}, another plugin's"
        raise RuleError(f"{where}: its template folder's name {folder.name!r} is taken ({owner}); give "
                        "the plugin's folder a name of its own")
    templates_named = [("template", family.template), ("launcher_template", family.launcher_template)]
    templates_named += [("head_template", family.head_template)] if family.head_template else []
    for what, name in templates_named:
        first, _, rest = name.partition("/")
        if first != folder.name or not (folder / rest).is_file():
            raise RuleError(f"{where}: its {what} {name!r} is not a file of {folder}; name it "
                            f"'{folder.name}/<file>', a file of that folder")
    for constant in sorted(family.module_constants):  # launcher templates read every family's by name
        if kn.constant_owner(constant) is not None:
            raise RuleError(f"{where}: its module constant {constant!r} is kernel family "
                            f"{kn.constant_owner(constant)!r}'s; give the constant a name of its own")
    for header in sorted(folder.glob("*.cuh")):
        if (BUILTIN_HEADERS / header.name).is_file() or ext.headers.get(header.name, header) != header:
            raise RuleError(f"{where}: a device header named {header.name} already exists; give the "
                            "plugin's header a name of its own")
        ext.headers[header.name] = header
    shown = folder.relative_to(ext.root).as_posix() if folder.is_relative_to(ext.root) else folder.name
    kn.PLUGIN_TEMPLATES[folder.name] = kn.TemplateFolder(folder, shown)
    return kn.register_family(family)


def _plugin_path(path: str | Path, ext: Extensions) -> Path:
    """``path`` as a plugin names it: relative to the module's file (or absolute)."""
    module = sys.modules.get(ext.loading)
    folder = Path(path)
    if not folder.is_absolute() and module is not None and getattr(module, "__file__", None):
        folder = Path(module.__file__).resolve().parent / folder
    return folder.resolve()


@contextlib.contextmanager
def loaded(modules: tuple[str, ...], root: Path) -> Iterator[Extensions]:
    """Import the plugin ``modules`` from ``root``; yield what they added; then remove it all (ops
    from the registry, the modules from sys.modules), so the next build starts clean."""
    global _active
    if _active is not None:
        raise RuntimeError("plugins are already loaded for a build in progress")
    ext = Extensions(root=root.resolve())
    # a plugin imported before, outside a build, is imported afresh, so it registers for this
    # build; the earlier import and its ops are put back after
    earlier = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_plugin(name, modules)}
    earlier_ops = {name: OPS.pop(name) for name in _outside_builds if name in OPS}
    ops_before = dict(OPS)
    families_before, templates_before = dict(kn.FAMILIES), dict(kn.PLUGIN_TEMPLATES)
    modules_before = set(sys.modules)
    sys.path.insert(0, str(root))
    _active = ext
    try:
        for name in modules:
            ext.loading = name
            _import(name, root)
        ext.loading = ""
        yield ext
    finally:
        _active = None
        sys.path.remove(str(root))
        OPS.clear()
        OPS.update(ops_before)
        OPS.update(earlier_ops)
        kn.FAMILIES.clear()
        kn.FAMILIES.update(families_before)
        kn.PLUGIN_TEMPLATES.clear()
        kn.PLUGIN_TEMPLATES.update(templates_before)
        for name in set(sys.modules) - modules_before:
            if _is_plugin_module(name, modules, root):  # fusegen's own lazy imports stay
                del sys.modules[name]
        sys.modules.update(earlier)


def _is_plugin(name: str, plugins: tuple[str, ...]) -> bool:
    """One of the plugin modules or a submodule of one."""
    return any(name == p or name.startswith(p + ".") for p in plugins)


def _is_plugin_module(name: str, plugins: tuple[str, ...], root: Path) -> bool:
    """A module the plugins brought in: one of them, a submodule, or any module from ``root``."""
    if _is_plugin(name, plugins):
        return True
    file = getattr(sys.modules.get(name), "__file__", None)
    return file is not None and Path(file).resolve().is_relative_to(root.resolve())


def _import(name: str, root: Path) -> None:
    """Import one plugin module; any failure is the user's to fix: a UsageError saying where."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise UsageError(f"plugin {name} not found: [tool.fusegen] plugins names modules importable from "
                             f"the project folder {root} (a package folder or a .py file there)") from None
        raise UsageError(f"plugin {name} failed to import: {_where(err)}") from None
    except (RuleError, ValueError) as err:  # a rule or op refused when defined
        raise UsageError(f"plugin {name}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a bug in the user's module, shown as a message
        raise UsageError(f"plugin {name} failed to import: {_where(err)}") from None


def _where(err: BaseException) -> str:
    """``file:line: Type: message`` of the innermost frame that raised ``err``."""
    frames = traceback.extract_tb(err.__traceback__)
    at = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
    return f"{at}{type(err).__name__}: {err}"


__all__ = ["BACKWARD", "ELEMENTWISE", "FORWARD", "GEMM", "NORM", "Arg", "KernelFamily", "KernelParam", "Launch", "OpDef",
           "Operand", "Param", "RowTraffic", "Rule", "RuleError", "Saves", "StageImpl", "TorchCall", "kernel_name", "loaded",
           "make_spec", "register_family", "register_op", "register_rule", "torch"]
