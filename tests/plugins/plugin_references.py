"""Float64 references for the plugin fixture's pipelines (tests/fixtures/plugin_project), written
from the ops' definitions with plain torch, independently of fusegen."""

from pathlib import Path

import torch.nn.functional as F

import references as R

PROJECT = Path(__file__).resolve().parent.parent / "fixtures" / "plugin_project"


def scaled_mlp(p, x):
    h = F.gelu(p["1.scale"] * F.linear(x, p["0.weight"], p["0.bias"]), approximate="tanh")
    return (p["4.scale"] * F.linear(h, p["3.weight"], p["3.bias"]),)


def axpy(p, x, r):
    return (0.5 * F.linear(x, p["0.weight"]) + r,)


def norm_scale(p, x):
    return (p["1.scale"] * R.rms_norm(x, p["0.weight"]),)


def softmax_head(p, x):
    return (F.linear(F.softmax(F.linear(x, p["0.weight"], p["0.bias"]), dim=-1), p["2.weight"], p["2.bias"]),)


# pipeline -> (class, reference, input features)
PIPELINES = {
    "scaled_mlp": ("ScaledMlp", scaled_mlp, 64),
    "axpy": ("Axpy", axpy, 64),
    "norm_scale": ("NormScale", norm_scale, 64),
    "softmax_head": ("SoftmaxHead", softmax_head, 64),
}
