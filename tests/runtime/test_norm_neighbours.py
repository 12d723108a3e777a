"""Ops around a norm: MakeExtraOutput and AddExtraInput with Bias and Dropout before and after a
LayerNorm or RMSNorm, the shapes whose norm stage starts at an op other than the norm (issue 36:
`MakeExtraOutput()` directly before a norm that a Dropout follows crashed the build with a
KeyError in the norm stage's backward). Each pipeline is generated into one CPU package and run
in float32 (training, eval, and the no-grad forward) against a float64 reference that applies
each op's definition in order (written here from the TE op catalog, sharing no code with the
generator): outputs, extra outputs, the input's and extra inputs' grads, every parameter grad.
The fuzz tests (tests/frontend/test_fuzz.py) generate every such shape; this file checks the
numbers of the ones that crashed and of a seeded sample of the rest."""

import itertools
import random

import pytest
import torch

from references import dropout_keep, next_keys, randomize_, run_and_compare
from spec_packages import imported_package

WIDTH = 64
EPS = 1e-5
SEED = 4321
AROUND = ("Bias", "Dropout", "AddExtraInput", "MakeExtraOutput")
CALLS = {"Linear": f"Linear({WIDTH}, {WIDTH})", "Bias": f"Bias({WIDTH})", "Dropout": "Dropout(0.25)",
         "AddExtraInput": "AddExtraInput()", "MakeExtraOutput": "MakeExtraOutput()",
         "LayerNorm": f"LayerNorm({WIDTH})", "RMSNorm": f"RMSNorm({WIDTH})"}

# the shapes that crashed, then a seeded sample of [Linear] (op)* norm (op)* with up to two ops a side
CRASHED = [
    ("MakeExtraOutput", "LayerNorm", "Dropout"),
    ("MakeExtraOutput", "RMSNorm", "Dropout"),
    ("Linear", "MakeExtraOutput", "LayerNorm", "Dropout"),
    ("Bias", "MakeExtraOutput", "RMSNorm", "Dropout", "MakeExtraOutput"),
    ("Linear", "MakeExtraOutput", "LayerNorm", "Dropout", "AddExtraInput", "Bias"),
]


def _sample(count: int) -> list[tuple[str, ...]]:
    every = [(*lead, *before, norm, *after)
             for lead in ((), ("Linear",)) for norm in ("LayerNorm", "RMSNorm")
             for before in itertools.chain.from_iterable(itertools.product(AROUND, repeat=k) for k in range(3))
             for after in itertools.chain.from_iterable(itertools.product(AROUND, repeat=k) for k in range(3))]
    return random.Random(36).sample([shape for shape in every if shape not in CRASHED], count)


SHAPES = CRASHED + _sample(15)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """One CPU-only package (no binaries) holding a pipeline per shape, imported once."""
    lines = ["import transformer_engine.pytorch as te\n"]
    for index, shape in enumerate(SHAPES):
        lines.append(f"shape{index} = te.ops.Sequential({', '.join('te.ops.' + CALLS[op] for op in shape)})\n")
    with imported_package(tmp_path_factory.mktemp("norm_neighbours"), "norm_neighbours_spec.py", "".join(lines),
                          "norm_neighbours_pkg") as pkg:
        yield pkg


def reference_for(shape, training):
    """float64 reference of ``shape`` (op names, spec order): the parameters of op i are
    ``i.weight`` / ``i.bias``; extra inputs are taken and extra outputs returned in spec order,
    after the output (TE's Sequential); in training each Dropout draws its key in forward order,
    in eval mode it passes x as it is."""
    def reference(p, x, *extra_inputs):
        torch.manual_seed(SEED)
        keys = iter(next_keys(shape.count("Dropout"), "cpu"))
        inputs, extra_outputs = iter(extra_inputs), []
        for i, op in enumerate(shape):
            if op == "Linear":
                x = x @ p[f"{i}.weight"].T + p[f"{i}.bias"]
            elif op == "Bias":
                x = x + p[f"{i}.bias"]
            elif op == "Dropout" and not training:
                pass
            elif op == "Dropout":
                keep = dropout_keep(next(keys), tuple(x.shape), 0.25)
                x = torch.where(keep, x / 0.75, torch.zeros_like(x))
            elif op == "AddExtraInput":
                x = x + next(inputs)
            elif op == "MakeExtraOutput":
                extra_outputs.append(x)
            elif op == "LayerNorm":
                mean = x.mean(-1, keepdim=True)
                var = (x - mean).square().mean(-1, keepdim=True)
                x = (x - mean) / torch.sqrt(var + EPS) * p[f"{i}.weight"] + p[f"{i}.bias"]
            elif op == "RMSNorm":
                x = x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS) * p[f"{i}.weight"]
            else:
                raise AssertionError(f"no reference for {op}")
        return (x, *extra_outputs)
    return reference


def check(package, index, training, no_grad=None):
    shape = SHAPES[index]
    module = getattr(package, f"Shape{index}")(dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(index))
    module.train(training)
    torch.manual_seed(SEED)  # the module's Dropout keys: the first draws after this
    run_and_compare(module, f"shape{index}", (2, 3, WIDTH), torch.float32, "cpu", seed=index,
                    reference=reference_for(shape, training), gemm="Linear" in shape, no_grad=no_grad)


IDS = ["-".join(shape) for shape in SHAPES]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("index", range(len(SHAPES)), ids=IDS)
def test_cpu_matches_the_float64_reference(package, index, training):
    check(package, index, training)


@pytest.mark.parametrize("index", range(len(SHAPES)), ids=IDS)
def test_cpu_no_grad_forward_matches_the_float64_reference(package, index):
    """The no-grad forward (its own plan: it keeps nothing for a backward), masks still drawn."""
    check(package, index, True, no_grad=torch.no_grad)
