"""fusegen's eager reference ``Sequential``: the registry's ops in plain, unfused PyTorch.

A spec may import its ops from here instead of Transformer Engine; the same file then runs
eagerly (``python specs/x.py``) without any generated code, and tests use these modules as the
unfused oracle for state_dict layout and parameter initialisation. Each op runs its OpDef's own
reference forward (generator/ops, the functions shipped as the output's ``_reference.py``);
gradients come from autograd through it.

    from fusegen.eager import Sequential, LayerNorm, Linear, GELU
    mlp = Sequential(LayerNorm(1024), Linear(1024, 4096), GELU(), Linear(4096, 1024))
    y = mlp(torch.randn(8, 1024))
"""

from __future__ import annotations

import torch

from .ops import OPS, OpDef, basic_parts, part_attribute, part_submodule
from .ops.binding import ArgumentError, bind, check_value
from .ops.attention import sequences_of
from .ops.attention_rotary_table import rotary_table_of, self_attention_from_table
from .ops.common import compute, deinterleave, draws, init_parameter, new_seed
from .ops.te_modules import TE_COMPOSITES, TE_MACROS


def rotated_attention(rows, cu_seqlens, rotary_pos_emb, reference_arguments, mode):
    """The attention op's reference forward on ``rows`` (its reference arguments: heads, kv_heads,
    causal, rotary_base, dropout; ``mode``: its training flag where dropout is on) with q and k
    rotated by TE's table, checked against the call (its dtype, device, rotated width and length)."""
    heads, kv_heads = reference_arguments[:2]
    head_dim = rows.shape[-1] // (heads + 2 * kv_heads)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if len(cu_seqlens) > 1 else 0
    table = rotary_table_of(rotary_pos_emb, head_dim, longest, rows.device)
    return self_attention_from_table(rows, cu_seqlens, *reference_arguments, table, **mode)


def bind_args(op: OpDef, args: tuple, kwargs: dict) -> dict:
    """Bind constructor arguments with the registry's one binder (ops.binding), as Python would:
    TypeError for a call that does not fit the signature, ValueError for a wrong value."""
    try:
        bound, _ = bind(op, args, [(name, name, value) for name, value in kwargs.items()],
                        lambda arg, value: check_value(op, arg, value))
    except ArgumentError as err:
        raise (ValueError if err.value_error else TypeError)(err.message) from None
    problem = op.validate(bound) if op.validate else None
    if problem:
        raise ValueError(f"{op.name}(): {problem}")
    return bound


class FusibleOp(torch.nn.Module):
    """One registered op (or container, or TE module) with its parameters registered under TE's
    names (a TE module's: ``fc1_weight``, ops.part_attribute)."""

    op_name = ""

    def __init__(self, *args, device=None, dtype=None, **kwargs):
        super().__init__()
        op = OPS[self.op_name]
        if any(a.name == "params_dtype" for a in op.args):  # a TE module's dtype=: a torch dtype, not read
            dtype = kwargs.pop("params_dtype", None) or dtype
        self.args = bind_args(op, args, kwargs)
        self.parts = basic_parts(self.op_name, self.args)
        self.basic = [(basic, basic_args) for basic, basic_args, _, _ in self.parts]
        self.residuals = op.residuals(self.args)
        for basic, basic_args, part, held in self.parts:
            holder = self
            for name in part_submodule(part).split(".") if part_submodule(part) else ():  # TE's submodules, nested
                if name not in holder._modules:  # (te.TransformerLayer's self_attention.proj) as TE nests them;
                    composite = name != part_submodule(part).rpartition(".")[2]  # one holding others: no state
                    holder.add_module(name, torch.nn.Module() if composite else TeSubmodule())
                holder = holder._modules[name]
            for p in basic.params:
                shape = p.shape(basic_args)
                buffer = torch.empty(shape, device=device, dtype=dtype)
                if held is None:
                    holder.register_parameter(part_attribute(part, p.name).rpartition(".")[2],
                                              torch.nn.Parameter(buffer))
                    continue
                start = 0  # TE's row blocks: slices of one buffer, as TE allocates them
                for name, block in held.held(p.name, shape):
                    holder.register_parameter(part_attribute(part, name).rpartition(".")[2],
                                              torch.nn.Parameter(buffer[start:start + block[0]]))
                    start += block[0]
        self.reset_parameters()

    def held_tensors(self, part: str, held, attr: str, shape) -> list[torch.nn.Parameter]:
        """The parameters held for the GEMM's parameter ``attr``: it, or TE's row blocks."""
        names = [name for name, _ in held.held(attr, shape)] if held else [attr]
        return [self.get_parameter(part_attribute(part, name)) for name in names]

    def reset_parameters(self) -> None:
        for basic, basic_args, part, held in self.parts:
            for p in basic.params:
                for tensor in self.held_tensors(part, held, p.name, p.shape(basic_args)):
                    init_parameter(tensor, p.init(basic_args))

    def gemm_parameter(self, part: str, held, attr: str, shape) -> torch.Tensor:
        """The tensor the GEMM reads for ``attr``: TE's row blocks concatenated (noop_cat), TE's
        rows grouped per GQA group gathered in [q | k | v] order (held_rows.HeldRows)."""
        tensors = self.held_tensors(part, held, attr, shape)
        if held is None:
            return tensors[0]
        if held.blocks:
            return torch.cat(tensors, dim=0)
        return tensors[0][torch.tensor(held.gemm_rows(shape[0]), device=tensors[0].device)]

    @property
    def num_extra_inputs(self) -> int:
        return sum(b.extra_inputs for b, _ in self.basic)

    def forward(self, x, extra_inputs=(), extra_outputs=None, cu_seqlens=None, rotary_pos_emb=None):
        """Apply the basic ops in order; extra inputs are consumed, extra outputs appended.
        ``cu_seqlens``: the packed sequences' offsets (int [batch + 1]) for an op that reads them
        (attention); without it a 3-D x is batch sequences and any other x one sequence.
        ``rotary_pos_emb``: TE's table of rotary angles [max_s, 1, 1, d] (te.MultiheadAttention's
        forward), rotating q and k of the attention op (ops/attention_rotary_table.py)."""
        if rotary_pos_emb is not None and not any(basic.reads_sequences for basic, _, _, _ in self.parts):
            raise ValueError("rotary_pos_emb rotates the q and k of an attention op, and this module has none; "
                             "leave it out")
        extra_inputs = list(extra_inputs)
        standalone = extra_outputs is None  # called on its own: returns (y, *extra outputs), as TE's modules do
        extra_outputs = [] if standalone else extra_outputs
        kept = {}  # a residual branch of a TE layer (OpDef.residuals): its input, for the add after it
        for position, (basic, a, part, held) in enumerate(self.parts):
            x = self.residual_add(position, x, kept)
            kept.update({end: x for first, end, _ in self.residuals if first == position})
            if basic.reshape is not None:  # TE's Reshape: torch.reshape (a view where it can be); autograd
                x = x.reshape(basic.reshape(a))  # reshapes the grad back to the input's shape
                continue
            forward = basic.reference[0]
            if forward is None:  # identity
                continue
            params = [self.gemm_parameter(part, held, p.name, p.shape(a)) for p in basic.params]
            form = basic.functor_form
            if form == "tee":  # an extra output: the value itself, handed out
                extra_outputs.append(forward(x))
            elif form is None:  # GEMMs and norms, over 2-D rows like the kernels; statistics dropped
                dims = basic.row_shape(a)
                if dims is not None:  # a norm over the last len(dims) dims: rows of their product
                    if tuple(x.shape[-len(dims):]) != tuple(dims):
                        raise ValueError(f"{basic.describe(a)} normalises the last {len(dims)} dims, so its input's "
                                         f"shape must end in {list(dims)}, got {list(x.shape)}")
                    y = forward(x.reshape(-1, basic.fixed_in(a)), *(p.reshape(-1) for p in params),
                                *basic.reference_arguments(a))[0]
                    x = y.reshape(x.shape)
                    continue
                lead = x.shape[:-1]
                if basic.reads_sequences:  # attention: per sequence, in compute's precision, one rounding
                    seq_first = a.get("qkv_format") == "sbhd"  # TE's [seq, batch, hidden]: each batch column
                    batch_major = x.transpose(0, 1) if seq_first else x
                    rows = batch_major.reshape(-1, x.shape[-1])
                    sequences = sequences_of(rows, batch_major.shape[:-1]) if cu_seqlens is None else cu_seqlens
                    mode = {"training": self.training} if basic.uses_training(a) else {}  # its dropout
                    if rotary_pos_emb is not None:  # TE's per-call table: q and k rotated by its angles
                        y = rotated_attention(compute(rows), sequences, rotary_pos_emb, basic.reference_arguments(a),
                                              mode).to(x.dtype)
                    else:
                        y = forward(compute(rows), sequences, *basic.reference_arguments(a), **mode).to(x.dtype)
                    y = y.reshape(*batch_major.shape[:-1], y.shape[-1])
                    x = y.transpose(0, 1) if seq_first else y
                    continue
                y = forward(x.reshape(-1, x.shape[-1]), *params, *basic.reference_arguments(a))
                y = y[0] if isinstance(y, tuple) else y
                x = y.reshape(*lead, y.shape[-1])
            else:  # elementwise ops: float64 math (compute) on the value and operand, one rounding
                operands, consumed = [], None
                source = basic.operand.source if basic.operand is not None else None
                if source == "param":
                    operands.append(params[0])
                elif source == "random":  # a fresh key in training, none (keep all) in eval
                    operands.append(draws(new_seed(x) if self.training else None, x))
                elif source == "extra_input":
                    consumed = extra_inputs.pop(0)
                    # one value per row (a row-scaled activation's scales) broadcasts over the row
                    operands.append(consumed.unsqueeze(-1) if basic.operand.broadcast == "row" else consumed)
                value = compute(x)
                if basic.interleave(a) is not None:  # blocks [a(k), b(k), ...] as halves [a | b]
                    value = deinterleave(value.reshape(-1, value.shape[-1]), basic.interleave(a)).reshape(value.shape)
                x = forward(value, *map(compute, operands), *basic.device_args(a)).to(x.dtype)
                if basic.writes_back(a):  # TE's AddExtraInput(in_place=True): the caller's tensor becomes the sum
                    with torch.no_grad():
                        consumed.copy_(x)
        x = self.residual_add(len(self.parts), x, kept)
        return (x, *extra_outputs) if standalone and extra_outputs else x

    def residual_add(self, position, x, kept):
        """x plus the input of the residual branch that ends before ``position`` (one rounding, as
        the generated add), else x."""
        residual = kept.pop(position, None)
        return x if residual is None else (compute(x) + compute(residual)).to(x.dtype)


class TeExtraState:
    """A TE module (te.LayerNormMLP, ...): TE's checkpoints hold an ``_extra_state`` entry per
    module, its FP8 scaling state (an empty uint8 tensor where FP8 never ran), saved and loaded
    as the generated module's holder does (the runtime's TeModuleOp, module_helpers.py)."""

    op_name = ""

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise RuntimeError(
            f"{self.op_name}: the checkpoint's _extra_state holds TE's FP8 scaling state (saved after training under "
            "FP8), which fusegen does not use yet; leave the '_extra_state' entries out of the dictionary and load "
            "it with strict=False (the parameters are all there)")


class TeModule(TeExtraState, FusibleOp):
    """One of TE's modules, with its _extra_state (TeExtraState)."""


class TeSubmodule(TeExtraState, torch.nn.Module):
    """One of TE's submodules of a TE module built of them (te.MultiheadAttention's layernorm_qkv,
    core_attention, proj): its parameters and its _extra_state, under TE's names."""

    op_name = "a TE submodule"


def _op_class(name: str) -> type:
    op = OPS[name]
    doc = f"{op.signature()}: {op.summary}" if op.summary else op.signature()
    base = TeModule if name in TE_MACROS and name not in TE_COMPOSITES else FusibleOp
    return type(name, (base,), {"op_name": name, "__doc__": doc, "__module__": __name__})


# One module class per registered op (Linear, RMSNorm, GELU, ...): a new op needs no line here.
globals().update({name: _op_class(name) for name, op in OPS.items() if __name__ in op.modules})


class Residual(torch.nn.Sequential):
    """``y = x + ops(x)``: its ops run in order on x and their output is added to x (one rounding,
    as the generated add). Nests in a Sequential and in another Residual; its ops are its children
    ("0.1.weight": the first Residual's second op), as the generated module's."""

    def __init__(self, *ops):
        if not ops:
            raise TypeError("Residual() needs at least one op: the residual branch, as in Residual(RMSNorm(n), "
                            "Linear(n, n))")
        for op in ops:
            if isinstance(op, torch.nn.Sequential) and not isinstance(op, Residual):
                raise TypeError("a Sequential cannot be nested in a Residual; list its ops in the Residual")
            if isinstance(op, FusibleOp) and any(b.extra_inputs or b.extra_outputs for b, _ in op.basic):
                raise ValueError(f"Residual() cannot hold {op.op_name}() (an extra input or output of the pipeline); "
                                 "move it out of the Residual")
        super().__init__(*ops)

    def forward(self, x):
        y = x
        for module in self:
            y = module(y)
        return (compute(x) + compute(y)).to(x.dtype)


class Sequential(torch.nn.Sequential):
    """Runs its ops in order: ``y = seq(x, *extra_inputs)``; returns ``y`` or ``(y, *extra_outputs)``."""

    def forward(self, x, *extra_inputs):
        needed = sum(getattr(m, "num_extra_inputs", 0) for m in self)
        if len(extra_inputs) != needed:
            raise TypeError(f"this Sequential takes {needed} extra input(s), got {len(extra_inputs)}")
        pending, outputs = list(extra_inputs), []
        for module in self:
            if not isinstance(module, FusibleOp):  # any other module runs as it is (TE's opaque blocks)
                x = module(x)
                continue
            n = module.num_extra_inputs
            x = module(x, pending[:n], outputs)
            pending = pending[n:]
        return (x, *outputs) if outputs else x


__all__ = ["Residual", "Sequential", *(name for name, op in OPS.items() if __name__ in op.modules)]
