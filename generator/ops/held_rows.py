"""How one of TE's modules holds a GEMM's weight and bias where they are not one tensor whose rows
are in the order the GEMM reads them:

- ``blocks``: named row blocks of one buffer (TE's ``parameters_split``: te.MultiheadAttention's
  ``query_weight``, ``key_weight``, ``value_weight`` and biases with ``fuse_qkv_params=False``,
  TE's default; module/layernorm_linear.py registers each as a slice of one weight tensor, so
  they lie one after another and ``noop_cat`` joins them without a copy);
- ``groups``: the rows of each GQA group together (TE's ``qkv_weight_interleaved=True`` with
  ``fuse_qkv_params=True``: per group its q heads, its k head, its v head; TE reads the
  projection as ``[groups, heads / groups + 2, head_dim]``), which fusegen's attention reads as
  ``[all q heads | all k heads | all v heads]``.

An expansion (``OpDef.expand``) gives a part this as the fourth item of its tuple. The generated
module (emit/held.py) and fusegen.eager hold the parameters so, under TE's names and shapes (the
state_dict keys), and hand the GEMM the one tensor it reads: runtime row_blocks' ``rows_view``
(a view of adjacent blocks; the module's Function takes the blocks too and hands each its grad;
``join_rows`` where user modules run between Functions) or ``grouped_rows`` (one gather a
forward). The kernels never see it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeldRows:
    blocks: tuple[tuple[str, int], ...] = ()  # (name, rows) in order: TE's parameters_split
    groups: tuple[int, int] | None = None  # (GQA groups, q heads a group): TE's qkv_weight_interleaved

    def held(self, attr: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each tensor held for the GEMM's parameter ``attr`` of ``shape``: TE's
        ``query_weight``, ``key_weight``, ``value_weight`` for the weight split in blocks (``{block}_
        {attr}``, TE's ``f"{name.rstrip('_')}_weight"``), else the one tensor."""
        if not self.blocks:
            return [(attr, shape)]
        return [(f"{name}_{attr}", (rows, *shape[1:])) for name, rows in self.blocks]

    def shard(self, ranks: int) -> HeldRows:
        """How a rank of a tensor-parallel group of ``ranks`` holds its share of a column-parallel
        GEMM's rows (tensor_parallel.py): its share of each block, whole GQA groups."""
        return HeldRows(blocks=tuple((name, rows // ranks) for name, rows in self.blocks),
                        groups=None if self.groups is None else (self.groups[0] // ranks, self.groups[1]))

    def gemm_rows(self, rows: int) -> list[int]:
        """The held tensor's row that the GEMM's row r reads, for each r < ``rows`` (fusegen.eager's
        gather: the reference; the generated module's runtime reshapes instead)."""
        if self.groups is None:
            return list(range(rows))
        groups, per_group = self.groups
        head_dim = rows // (groups * (per_group + 2))

        def heads(slots):  # TE's row of (group, slot, d): ((group * (per_group + 2)) + slot) * head_dim + d
            return [(g * (per_group + 2) + slot) * head_dim + d for g in range(groups) for slot in slots
                    for d in range(head_dim)]

        return heads(range(per_group)) + heads((per_group,)) + heads((per_group + 1,))

    @property
    def copies(self) -> bool:
        """Whether the GEMM's tensor is a new one every forward (grouped rows: gathered), so a CUDA
        graph copies it in as it does x rather than read it where it was at capture."""
        return self.groups is not None

    def describe(self) -> str:
        """What the module holds, for a comment in the generated code."""
        if self.blocks:
            return "TE's parameters_split, row blocks of one buffer"
        groups, per_group = self.groups
        return (f"TE's qkv_weight_interleaved, rows per GQA group ({groups} of {per_group} q heads, a k head, "
                "a v head)")
