"""The statement walk: a parsed spec read top to bottom, like Python would run it.

Imports and constants update the scope; ``NAME = Sequential(...)`` becomes a SequentialSpec.
Compound statements are not run: names they bind become unusable, and a pipeline inside one, a
``:=`` or a Sequential(...) anywhere but ``NAME = ...`` at module level is an error.
"""

from __future__ import annotations

import libcst as cst

from ..errors import SpecError
from ..names import NameTable
from ..ops import SEQUENTIAL, SEQUENTIAL_MODULES, op_modules
from .calls import OpBinder, SequentialSpec, close_match
from .scope import Scope, _Bindings, _dotted, _ident, _Scan
from .source import SpecSource, _short
from .values import ConstantFolder

# What a compound statement is called in messages, by its type.
_KEYWORDS = {
    cst.If: "if", cst.For: "for", cst.While: "while", cst.Try: "try", cst.TryStar: "try", cst.With: "with",
    cst.Match: "match", cst.FunctionDef: "def", cst.ClassDef: "class",
}


class _SpecReader:
    """Reads the module-level statements of one parsed ``SpecSource``."""

    def __init__(self, source: SpecSource):
        self.source = source
        self.scope = Scope()
        self.folder = ConstantFolder(source, self.scope)
        self.binder = OpBinder(source, self.scope, self.folder)
        self.names = NameTable()  # pipelines of this file

    def read(self) -> list[SequentialSpec]:
        specs: list[SequentialSpec] = []
        for statement in self.source.module.body:
            if not isinstance(statement, cst.SimpleStatementLine):
                self.read_compound(statement)
                continue
            for small in statement.body:
                spec = self.read_simple(small)
                if spec is not None:
                    specs.append(spec)
        if not specs:
            raise SpecError(f"no 'NAME = Sequential(...)' pipeline found in {self.source.display}",
                            self.source.location_at(1, 1))
        return specs

    def read_simple(self, small: cst.BaseSmallStatement) -> SequentialSpec | None:
        """One module-level small statement: a pipeline (returned), an import, or a constant."""
        if isinstance(small, (cst.Import, cst.ImportFrom)):
            self.scope.record_import(small, self.source.loc(small).line)
            return None
        pipeline = self.pipeline_target(small)
        # NAME = Sequential(...) itself is read by the binder, which refuses a Sequential(...) in
        # it: the scan looks there for := only, most of a spec's reading time saved
        scan = self.scan(small, self.source.scan_lines if pipeline is None else self.source.walrus_lines)
        self.reject_walrus(scan)
        if pipeline is not None:
            return self.read_pipeline(*pipeline)
        self.reject_stray_sequential(scan)
        if isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None:
            self.reject_lost_pipeline(small.value)
        if isinstance(small, cst.Assign):
            for target in small.targets:
                self.folder.record_assignment(target.target, small.value)
        elif isinstance(small, cst.AnnAssign) and small.value is not None:
            self.folder.record_assignment(small.target, small.value)
        elif isinstance(small, cst.AugAssign):
            self.folder.record_augmented(small)
        elif isinstance(small, cst.Del):
            bindings = _Bindings()
            small.visit(bindings)
            for name in bindings.names:
                self.scope.forget(name, f"line {self.source.loc(small).line} deletes it")
        return None

    def read_compound(self, statement: cst.BaseCompoundStatement) -> None:
        """if/for/try/def/class...: not evaluated, but imports in it count (try: import ... except
        ImportError) and names it rebinds are no longer known constants. A pipeline in it would be
        silently missing, so that is an error."""
        bindings = _Bindings()
        statement.visit(bindings)
        line = self.source.loc(statement).line
        keyword = _KEYWORDS.get(type(statement)) or self.source.code(statement).split()[0]
        for name in bindings.names:
            self.scope.forget(name, f"line {line} binds it inside '{keyword}', which fusegen does not run")
        for node in bindings.imports:
            self.scope.record_import(node, self.source.loc(node).line)
        found = self.scan(statement).sequential
        if found:
            raise SpecError(f"a pipeline must be defined at module level: fusegen does not run the '{keyword}' "
                            f"at line {line}, so it would never see this one; write NAME = Sequential(...) at "
                            "the top level of the file", self.source.loc(found[0]))

    def pipeline_target(self, small: cst.BaseSmallStatement) -> tuple[list[cst.BaseExpression], cst.Call] | None:
        """(targets, call) if ``small`` assigns a Sequential(...) call, else None."""
        if isinstance(small, cst.Assign):
            targets = [t.target for t in small.targets]
        elif isinstance(small, cst.AnnAssign) and small.value is not None:
            targets = [small.target]
        else:
            return None
        value = small.value
        if isinstance(value, cst.Call) and self.scope.op_name(value) == SEQUENTIAL:
            return targets, value
        return None

    def read_pipeline(self, targets: list[cst.BaseExpression], call: cst.Call) -> SequentialSpec:
        """``NAME = Sequential(...)``: the name is checked (it becomes a module and a class) first."""
        if len(targets) != 1 or not isinstance(targets[0], cst.Name):
            raise SpecError("a pipeline must be assigned to one plain name: NAME = Sequential(...)",
                            self.source.loc(targets[0]))
        name, where = targets[0].value, self.source.loc(targets[0])
        self.names.claim(name, where)
        spec = self.binder.sequential(name, where, call)
        self.scope.forget(_ident(name), f"line {where.line} makes it a pipeline")
        return spec

    # --- what a module-level statement may not hold ---------------------------------------------

    def scan(self, node: cst.CSTNode, lines: set[int] | None = None) -> _Scan:
        """What ``node`` holds that the reader must refuse; visited only where one of ``lines``
        (default: every line where a call or a := starts) falls within it."""
        scan = _Scan(self.scope)
        where = self.source.positions[node]
        lines = self.source.scan_lines if lines is None else lines
        if any(line in lines for line in range(where.start.line, where.end.line + 1)):
            node.visit(scan)
        return scan

    def reject_walrus(self, scan: _Scan) -> None:
        """``:=`` in a module-level statement binds a module-level name fusegen does not evaluate."""
        if scan.walruses:
            walrus = scan.walruses[0]
            target = self.source.code(walrus.target)
            raise SpecError(f"fusegen does not evaluate ':=' (here it would bind '{target}'); write "
                            f"{_short(f'{target} = {self.source.code(walrus.value)}', 60)} on a line of its own",
                            self.source.loc(walrus.target))

    def reject_lost_pipeline(self, value: cst.BaseExpression) -> None:
        """``NAME = <call>`` whose callee is spelled like Sequential but is not one (misspelt,
        never imported, or from another module), or that holds op calls under a callee that is
        not Sequential: a pipeline the file means, which would otherwise be skipped without a word
        (another pipeline of the file still generates)."""
        if not isinstance(value, cst.Call) or _dotted(value.func) is None:
            return
        spelled = self.source.code(value.func)
        target = self.scope.resolve(value.func)
        attribute = target[1] if target is not None else spelled.rpartition(".")[2]
        ours = target is None or target[0] in SEQUENTIAL_MODULES or target[0] in op_modules()
        holds_ops = ours and any(isinstance(arg.value, cst.Call) and self.scope.op_name(arg.value) is not None
                                 for arg in value.args)
        # a close spelling only: a helper of the user's named like "essential" (0.74 alike) is not one
        if close_match(attribute, [SEQUENTIAL], cutoff=0.85) is None and not holds_ops:
            return
        if target is None:
            head = _ident(spelled.partition(".")[0])
            rebound = self.scope.not_constant.get(head)
            why = f"'{head}' is not imported" + (f" here: {rebound}" if rebound else "")
            fix = ("import it: from transformer_engine.pytorch.ops import Sequential" if spelled == SEQUENTIAL
                   else f"did you mean '{spelled[:len(spelled) - len(attribute)]}{SEQUENTIAL}'?")
        elif target[0] not in SEQUENTIAL_MODULES:
            why = f"it is {'.'.join(target)}, not the Sequential of {' or '.join(SEQUENTIAL_MODULES)}"
            fix = "import Sequential from one of those"
        else:
            why = f"{target[0]} has no '{attribute}'"
            fix = f"did you mean '{spelled[:len(spelled) - len(attribute)]}{SEQUENTIAL}'?"
        raise SpecError(f"'{spelled}(...)' is not a Sequential ({why}), so fusegen would skip this pipeline; {fix}",
                        self.source.loc(value.func))

    def reject_stray_sequential(self, scan: _Scan) -> None:
        if scan.sequential:
            raise SpecError("a pipeline must be written as NAME = Sequential(...) at module level; "
                            "fusegen does not run code that builds it", self.source.loc(scan.sequential[0]))
