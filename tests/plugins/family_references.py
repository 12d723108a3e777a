"""Float64 references for the kernel-family fixture's pipelines (tests/fixtures/family_project),
written from the definition of softmax with plain torch, independently of the plugin."""

from pathlib import Path

import torch.nn.functional as F

PROJECT = Path(__file__).resolve().parent.parent / "fixtures" / "family_project"


def softmax64(x):
    """softmax over the last dim, as defined: exp(x - max) / sum(exp(x - max)) (the max only keeps
    exp in range; it cancels). Differentiable, so autograd gives the reference input grad."""
    e = (x - x.amax(-1, keepdim=True).detach()).exp()
    return e / e.sum(-1, keepdim=True)


def row_softmax(p, x):
    return (softmax64(x),)


def softmax_head(p, x):
    return (F.linear(softmax64(x), p["1.weight"], p["1.bias"]),)


# pipeline -> (class, reference, input features, whether it holds a GEMM)
PIPELINES = {
    "row_softmax": ("RowSoftmax", row_softmax, 256, False),
    "softmax_head": ("SoftmaxHead", softmax_head, 1000, True),
}
