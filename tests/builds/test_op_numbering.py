"""One numbering of ops, the spec's: the plan's tables and diagrams, the generated module's
docstring, stage comments, children and parameter names, and the comments at each kernel launch
all cite an op by its position in the spec's Sequential as written (the eager Sequential's child
index, the state_dict prefix), lettered where one spec op runs as several basic ops. Kernels,
shared by every pipeline that runs their ops, number their steps from 0 and cite no op number.

The expected numbering is written out by hand from the spec below and its lines read with ``ast``,
not taken from fusegen."""

import ast
import re
import textwrap
from itertools import dropwhile, takewhile

import pytest

from fusegen import build

SPEC = textwrap.dedent("""\
    from fusegen.eager import (
        AddExtraInput, Bias, ConstantScale, GELU, Identity, LayerNorm, Linear, Sequential, SiLU)

    numbered = Sequential(
        LayerNorm(64),
        Linear(64, 128),
        GELU(),
        Identity(),
        AddExtraInput(in_place=True),
        ConstantScale(0.5),
        Bias(128),
        SiLU(),
        Linear(128, 64),
    )
""")

# (number, basic op) in order: Linear runs as BasicLinear + Bias, an in-place add as the add and
# the tee that writes the sum back; Identity (3) is a view, which runs nothing but keeps its number.
EXPECTED = [
    ("0", "LayerNorm"), ("1a", "BasicLinear"), ("1b", "Bias"), ("2", "GELU"), ("3", "Identity"),
    ("4a", "AddExtraInput"), ("4b", "MakeExtraOutput"), ("5", "ConstantScale"), ("6", "Bias"), ("7", "SiLU"),
    ("8a", "BasicLinear"), ("8b", "Bias"),
]
NAMES = dict(EXPECTED)
PARTS = {"Linear": ("BasicLinear", "Bias"), "AddExtraInput": ("AddExtraInput", "MakeExtraOutput")}  # in_place=True
RUNNING = [number for number, name in EXPECTED if name != "Identity"]  # what the stages run


def spec_calls() -> list[tuple[str, int]]:
    """(op name, line) of each op of the Sequential, in order, read with ast."""
    call = next(node for node in ast.walk(ast.parse(SPEC))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Sequential")
    return [(arg.func.id, arg.lineno) for arg in call.args]


def spec_index(number: str) -> int:
    return int(number.rstrip("abcdefghijklmnopqrstuvwxyz"))


def op_name(call: str) -> str:
    return call.strip("` ").split("(")[0]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    root = tmp_path_factory.mktemp("numbering")
    (root / "numbered.py").write_text(SPEC)
    config = build.Config((root / "numbered.py",), root / "out", archs=("sm_90",), dtypes=("float32",), root=root)
    files = build.build_package(config)
    return {name: data.decode() for name, data in files.items() if not name.endswith((".cubin", ".ptx"))}


def table(plan: str, heading: str) -> list[list[str]]:
    """The rows of the first table under ``heading``, as cells."""
    lines = plan.split(f"\n## {heading}\n", 1)[1].split("\n")
    rows = takewhile(lambda line: line.startswith("|"), dropwhile(lambda line: not line.startswith("|"), lines))
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in list(rows)[2:]]  # past the header and its rule


def cited(cell: str) -> list[str]:
    return [number.strip() for number in cell.split(",")]


def test_the_plans_ops_table_numbers_ops_as_the_spec_does(package):
    rows = table(package["numbered.plan.md"], "Ops")
    assert [(row[0], op_name(row[1].split("`")[1])) for row in rows] == EXPECTED
    calls = spec_calls()
    for number, _, _, line in rows:  # each row is a part of the spec's op of its number, at its line
        spec_op, spec_line = calls[spec_index(number)]
        assert int(line) == spec_line and NAMES[number] in PARTS.get(spec_op, (spec_op,)), number


@pytest.mark.parametrize("heading", ["Forward", "Backward (runs bottom to top)"])
def test_the_stage_tables_cite_every_op_that_runs_once_by_its_number(package, heading):
    stages = table(package["numbered.plan.md"], heading)
    numbers = [number for row in stages for number in cited(row[1])]
    assert sorted(numbers, key=RUNNING.index) == RUNNING


def test_the_diagrams_label_ops_with_their_numbers(package):
    labels = re.findall(r'\w+_(\w+)\["(\w+): (\w+)\(', package["numbered.plan.md"])
    assert labels, "the plan's diagrams label no op"
    for node, number, name in labels:
        assert node == number and NAMES[number] == name


def test_the_module_cites_and_names_ops_by_their_numbers(package):
    module = package["numbered.py"]
    docstring = re.findall(r"^        (\w+)\(.*\),  # op (\w+)", module, re.M)
    assert [(number, name) for name, number in docstring] == [
        (number, name) for number, name in EXPECTED if name != "MakeExtraOutput"]  # the hidden tee is not the spec's
    # stage comments: "# forward stage 2 · rule elementwise · ops 2, 4a, ...: GELU(), ..."
    comments = re.findall(r"# ((?:forward|backward|no-grad) stage \d+ · rule \w+ · ops? [^:]+: .*(?:\n\s*# .*)*)", module)
    assert len(comments) >= 8
    for comment in comments:
        text = re.sub(r"\n\s*# ", " ", comment)
        numbers, calls = re.match(r".* · ops? ([^:]+): (.*?)(?: · weight grads?| · no kernel)?$", text).groups()
        names = re.findall(r"(\w+)\((?:[^()]|\([^()]*\))*\)", calls)
        assert [NAMES[n] for n in cited(numbers)] == names, comment
    # children: one per op of the spec, keyed by its index, printing its call
    children = re.findall(r'self\.add_module\("(\d+)", SpecOp\("(\w+)\(', module)
    assert children == [(str(i), name) for i, (name, _) in enumerate(spec_calls())]
    # a parameter's name carries the number of the op that holds it
    params = re.findall(r"^        ([a-z]+)(\d+)_(\w+) = self\._modules\[\"(\d+)\"\]\.(\w+)$", module, re.M)
    assert len(params) == 7
    for stem, index, attr, key, attribute in params:
        assert (index, attr) == (key, attribute)
        assert stem == spec_calls()[int(index)][0].lower()


def test_kernels_number_their_steps_and_the_launch_comment_maps_them_to_the_spec(package):
    module, kernel_sources = package["numbered.py"], {
        name.removeprefix("kernels/").removesuffix(".cu"): text
        for name, text in package.items() if name.endswith(".cu")}
    for source in kernel_sources.values():
        assert not re.search(r"//.*\bop \d", source), "a kernel cites an op number, which is a pipeline's"
    launches = re.findall(r"# (?:forward|backward) stage \d+ · rule elementwise\w* · ops? ([^:]+): .*\n"
                          r"(?:\s*# .*\n)*.*?kernels\.(\w+)\(", module)
    assert len(launches) == 2  # the fused run's forward and backward
    for numbers, kernel in launches:
        steps = sorted({(int(k), label) for k, label in re.findall(r"// step (\d+): (\w+)\(", kernel_sources[kernel])})
        assert [k for k, _ in steps] == list(range(len(steps)))
        assert [label for _, label in steps] == [NAMES[n] for n in cited(numbers)], kernel
