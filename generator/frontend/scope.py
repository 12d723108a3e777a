"""Module-level names as the reader goes down the file: what each one is bound to at this line.

A name is an import the reader follows (an alias to a dotted path, through which calls resolve
to ops), a constant with its current value, or unusable with the reason why. Names are compared
as Python binds them (NFKC-normalised). The visitors here find what a statement binds
(``_Bindings``) and what in it the reader must refuse (``_Scan``).
"""

from __future__ import annotations

import unicodedata

import libcst as cst

from ..ops import OPS, RESIDUAL, SEQUENTIAL, SEQUENTIAL_MODULES, op_modules, op_named


def _dotted(node: cst.BaseExpression) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return _ident(node.value)
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return f"{base}.{_ident(node.attr.value)}" if base else None
    return None


def _ident(name: str) -> str:
    """A name as Python binds it: identifiers are NFKC-normalised ('ﬁ' is 'fi'); libcst gives the raw text."""
    return unicodedata.normalize("NFKC", name)


class Scope:
    """The file's module-level names: imports followed, constants and their values, names unusable."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> dotted import path
        self.constants: dict[str, object] = {}  # module-level constant -> current value
        self.not_constant: dict[str, str] = {}  # name -> why it cannot be used as a constant

    def forget(self, name: str, why: str) -> None:
        """``name`` was rebound to something that is neither an import we track nor a constant."""
        self.aliases.pop(name, None)
        self.constants.pop(name, None)
        self.not_constant[name] = why

    def set_constant(self, name: str, value: object) -> None:
        self.aliases.pop(name, None)
        self.not_constant.pop(name, None)
        self.constants[name] = value

    def record_import(self, node: cst.Import | cst.ImportFrom, line: int) -> None:
        """An import statement at ``line``: the names it binds become aliases of what they import."""
        if isinstance(node, cst.Import):
            for alias in node.names:
                full = _dotted(alias.name) or ""
                # `import a.b.c as x` binds x to a.b.c; `import a.b.c` binds only `a`.
                local, target = (_ident(alias.asname.name.value), full) if alias.asname else (full.split(".")[0],) * 2
                self.forget(local, f"line {line} imports it")
                self.aliases[local] = target
            return
        base = _dotted(node.module) if node.module is not None and not node.relative else None
        if isinstance(node.names, cst.ImportStar):
            # An op module exports its ops and Sequential; what any other module binds is unknown,
            # and names it would bind stay unresolved ("unknown op").
            if base in op_modules() or base in SEQUENTIAL_MODULES:
                spelled = [op.attribute for op in OPS.values() if base in op.modules] + [SEQUENTIAL, RESIDUAL]
                for name in [name for name in spelled if op_named(base, name)]:
                    self.forget(name, f"line {line} imports it")
                    self.aliases[name] = f"{base}.{name}"
            return
        for alias in node.names:
            name = _ident(alias.name.value) if isinstance(alias.name, cst.Name) else _dotted(alias.name) or ""
            local = _ident(alias.asname.name.value) if alias.asname is not None else name
            self.forget(local, f"line {line} imports it")
            if base is not None:  # relative imports are never op modules
                self.aliases[local] = f"{base}.{name}"

    def resolve(self, node: cst.BaseExpression) -> tuple[str, str] | None:
        """(module, attribute) that a callee names, through the file's imports."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head not in self.aliases:
            return None
        full = self.aliases[head] + (f".{rest}" if rest else "")
        module, _, attr = full.rpartition(".")
        return module, attr

    def op_name(self, call: cst.Call) -> str | None:
        """The registry name of the op (or SEQUENTIAL) a call constructs, or None if it is not one."""
        target = self.resolve(call.func)
        return None if target is None else op_named(*target)


class _Bindings(cst.CSTVisitor):
    """Names a compound statement (if/for/try/with...) binds at module scope, and its imports.

    Function and class bodies are their own scopes: only the def/class name itself is bound.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.imports: list[cst.Import | cst.ImportFrom] = []

    def add_target(self, node: cst.CSTNode) -> None:
        if isinstance(node, cst.Name):
            self.names.append(_ident(node.value))
        elif isinstance(node, (cst.Tuple, cst.List)):
            for element in node.elements:
                self.add_target(element.value)
        elif isinstance(node, cst.StarredElement):
            self.add_target(node.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.names.append(_ident(node.name.value))
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.names.append(_ident(node.name.value))
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.add_target(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self.add_target(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.add_target(node.target)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self.add_target(node.target)

    def visit_For(self, node: cst.For) -> None:
        self.add_target(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:  # with ... as x, except E as x
        self.add_target(node.name)

    def visit_Del(self, node: cst.Del) -> None:
        self.add_target(node.target)

    def visit_Import(self, node: cst.Import) -> bool:
        self.imports.append(node)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        self.imports.append(node)
        return False


class _Scan(cst.CSTVisitor):
    """One pass over a module-level statement for what the reader must refuse in it.

    Calls to Sequential anywhere (to reject ones that are not NAME = ...), function and lambda
    bodies too: fusegen never runs them, so a pipeline built there would be silently missing.
    And ``:=`` expressions that bind a module-level name: not those in a lambda body, its own
    scope (its parameter defaults are evaluated where it stands).
    """

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.sequential: list[cst.Call] = []
        self.walruses: list[cst.NamedExpr] = []
        self.lambda_bodies = 0

    def visit_Lambda_body(self, node: cst.Lambda) -> None:
        self.lambda_bodies += 1

    def leave_Lambda_body(self, node: cst.Lambda) -> None:
        self.lambda_bodies -= 1

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        if not self.lambda_bodies:
            self.walruses.append(node)

    def visit_Call(self, node: cst.Call) -> None:
        if self.scope.op_name(node) == SEQUENTIAL:
            self.sequential.append(node)
