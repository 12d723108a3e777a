"""A self-attention op → its own stage (stages/attention/): a generated prep kernel (split and
rotary into one buffer; none without rotary), FlashAttention-2 varlen through PyTorch on CUDA
bf16/fp16 (the op's reference math otherwise), and in the backward FA2's then the prep kernel's
backward (the rotary's transpose into the projection's grad)."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import ATTENTION

FORWARD_ATTENTION = Rule(
    name="attention", pass_=FORWARD, stage=ATTENTION, doc="prep kernel (split, rotary) + FlashAttention-2 varlen (torch)",
    pattern=("attention",),
)
BACKWARD_ATTENTION = Rule(
    name="attention_backward", pass_=BACKWARD, stage=ATTENTION,
    doc="FlashAttention-2 varlen backward (torch) + prep backward kernel (rotary's transpose)", pattern=("attention",),
)
