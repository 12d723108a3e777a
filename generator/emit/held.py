"""A generated module's parameters as its children hold them: the lines of ``__init__``,
``reset_parameters`` and ``forward`` that create, initialise and read each, under the spec-level
op's names (the state_dict keys). Where one of TE's modules holds a GEMM's parameter otherwise than
as one tensor in the GEMM's row order (ops/held_rows.py: TE's query/key/value row blocks, TE's rows
grouped per GQA group), the module holds TE's tensors and the forward hands the pipeline the one
tensor its GEMM reads (runtime row_blocks), after their checks. The stages never see the
difference; a module's one Function takes TE's row blocks themselves too, after its stages'
arguments, and hands each its grad (function.py), so a call costs no autograd node of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.te_modules import TE_COMPOSITES, TE_MACROS


def child_module(path: str) -> str:
    """The generated module's child at ``path`` (an op's ``module_index``: "3", or "0.1" inside the
    first Residual, whose children nest as the eager module's do), as an expression."""
    return "self" + "".join(f'._modules["{part}"]' for part in path.split(".") if path)


def placement(op) -> tuple[str, str]:
    """The device= and dtype= expressions for ``op``'s parameters: the module's own arguments, or
    where the spec placed the op (TE's device=/dtype=) when the module is given none."""
    device, dtype = op.args.get("device"), op.args.get("dtype")
    return ("device" if device is None else f"device if device is not None else {device!r}",
            "dtype" if dtype is None else f"dtype if dtype is not None else {dtype!r}")


@dataclass(frozen=True)
class Held:
    """One parameter of the pipeline (the value its Function takes, ``name``) and the tensors
    the module holds for it: (attribute on the child, state_dict key, shape, the forward's local)."""

    op: object  # pipeline.Op
    attr: str
    name: str
    shape: tuple[int, ...]
    init: str
    tensors: tuple[tuple[str, str, tuple[int, ...], str], ...]

    @property
    def child(self) -> str:
        return child_module(self.op.module_index)

    @property
    def blocks(self) -> bool:
        """Whether TE's module holds it as named row blocks of one buffer (parameters_split)."""
        return self.op.held_rows is not None and bool(self.op.held_rows.blocks)

    @property
    def copies(self) -> bool:
        """Whether the forward hands the pipeline a new tensor each call (HeldRows.copies)."""
        return self.op.held_rows is not None and self.op.held_rows.copies

    def init_lines(self) -> list[str]:
        device, dtype = placement(self.op)
        empty = f"torch.empty({self.shape}, device={device}, dtype={dtype})"
        if not self.blocks:
            return [f"{self.child}.{self.tensors[0][0]} = torch.nn.Parameter({empty})"]
        lines = [f"{self.name} = {empty}  # {self.op.held_rows.describe()}"]
        start = 0
        for attribute, _, shape, _ in self.tensors:
            lines.append(f"{self.child}.{attribute} = torch.nn.Parameter({self.name}[{start}:{start + shape[0]}])")
            start += shape[0]
        return lines

    def reset_lines(self) -> list[str]:
        return [f'ref.init_parameter({self.child}.{attribute}, "{self.init}")' for attribute, *_ in self.tensors]

    def read_lines(self) -> list[str]:
        """The forward's reads of the tensors held, each through its submodules' ``_modules``
        (TE's ``self_attention.layernorm_qkv``): a Module.__getattr__ a submodule costs host time
        at a few rows."""
        lines = []
        for attribute, _, _, local in self.tensors:
            *submodules, name = attribute.split(".")
            path = "".join(f'._modules["{submodule}"]' for submodule in submodules)
            lines.append(f"{local} = {self.child}{path}.{name}")
        return lines

    def handed_lines(self, function_takes_blocks: bool) -> list[str]:
        """The forward's lines that make the tensor the GEMM reads from the ones held (none for one
        tensor in the GEMM's order). ``function_takes_blocks``: the module's one Function takes TE's
        row blocks after its stages' arguments (rows_view: no autograd node), else autograd joins
        them (join_rows: a module running user modules between Functions)."""
        held = self.op.held_rows
        if held is None:
            return []
        if held.blocks:  # TE's noop_cat
            locals_ = ", ".join(self.block_locals())
            if function_takes_blocks:
                return [f"{self.name} = rows_view({locals_})  # {held.describe()}: a view while adjacent; the "
                        "Function takes the blocks too"]
            return [f"{self.name} = join_rows({locals_})  # {held.describe()}: a view while adjacent"]
        groups, per_group = held.groups
        return [f"{self.name} = grouped_rows({self.name}, {groups}, {per_group})  # {held.describe()}, as [q | k | "
                "v]: a copy"]

    def block_locals(self) -> list[str]:
        """The forward's locals of TE's row blocks, in row order (none for a parameter held whole)."""
        return [local for *_, local in self.tensors] if self.blocks else []

    def block_rows(self) -> tuple[int, ...]:
        """The rows of each of TE's row blocks, in order."""
        return tuple(shape[0] for _, _, shape, _ in self.tensors) if self.blocks else ()

    def block_attributes(self) -> tuple[str, ...]:
        """The row blocks' attributes on their holder (``query_weight``, ...), for adjacent_rows."""
        return tuple(attribute.rpartition(".")[2] for attribute, *_ in self.tensors) if self.blocks else ()

    def holder(self) -> str:
        """The expression of the (sub)module that holds the tensors."""
        submodule = self.tensors[0][0].rpartition(".")[0]
        return f"{self.child}.{submodule}" if submodule else self.child


def held_parameters(p) -> list[Held]:
    """Every parameter of pipeline ``p`` in order, with the tensors its module holds for it."""
    params = []
    for op in p.ops:
        for attr, _, shape, init in op.params:
            name = p.value(op.param(attr)).name
            pairs = op.held_rows.held(attr, shape) if op.held_rows is not None else [(attr, shape)]
            tensors = []
            for held_name, held_shape in pairs:
                attribute = op.holder_attribute(held_name)
                local = name if held_name == attr else f"{op.module_hint}_{attribute.replace('.', '_')}"
                tensors.append((attribute, f"{op.module_index}.{attribute}", held_shape, local))
            params.append(Held(op, attr, name, shape, init, tuple(tensors)))
    return params


def fresh_parameters(params: list[Held], compiled: bool = False) -> frozenset[int]:
    """The parameter values the forward hands the pipeline as a new tensor each call (TE's
    interleaved rows gathered; ``compiled``: under torch.compile, where TE's row blocks are joined
    by ``torch.cat``, those too): a CUDA graph copies them in as it does x, never reading them where
    they were at its capture."""
    return frozenset(param.op.param(param.attr) for param in params if param.copies or (compiled and param.blocks))


def runtime_helpers(params: list[Held], function_takes_blocks: bool) -> list[str]:
    """The runtime's functions the module's held parameters need (``function_takes_blocks``: as
    Held.handed_lines)."""
    helpers = set()
    joins = {"rows_view", "split_rows"} if function_takes_blocks else {"join_rows"}
    for param in params:
        if param.op.held_rows is not None:
            helpers |= {"adjacent_rows", "rows_after_load", *joins} if param.blocks else {"grouped_rows"}
    return sorted(helpers)


def te_holder(spec_op: str) -> str:
    """The runtime's class holding a spec-level op: TeModuleOp for one of TE's modules (its
    _extra_state entry), SpecOp for the others and for a TE module built of TE's modules, whose
    submodules hold theirs (TE_COMPOSITES)."""
    return "TeModuleOp" if spec_op in TE_MACROS and spec_op not in TE_COMPOSITES else "SpecOp"
