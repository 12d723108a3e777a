"""A self-attention op → its own stage (stages/attention.py): FlashAttention-2 varlen through
PyTorch on CUDA bf16/fp16, the op's reference math otherwise. Nothing fuses into it yet (the
prep kernel around it is a later step)."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import ATTENTION

FORWARD_ATTENTION = Rule(
    name="attention", pass_=FORWARD, stage=ATTENTION, doc="FlashAttention-2 varlen (torch), split and rotary by torch ops",
    pattern=("attention",),
)
BACKWARD_ATTENTION = Rule(
    name="attention_backward", pass_=BACKWARD, stage=ATTENTION,
    doc="FlashAttention-2 varlen backward (torch), the rotary's transpose by torch ops", pattern=("attention",),
)
