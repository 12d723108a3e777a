"""Fuzzing the whole path from spec text to plans and generated code: never a traceback (issues
10, 36).

Every text, however malformed, must give plans or a SpecError whose location is inside the file
(and quotes that line). The texts, 10,905 of them, are generated from the op catalog (sane
pipelines with some arguments swapped for edge values; pairs of files planned as one build; the
ops around norms, where the norm stages take several shapes), mutated from the shipped specs and
from generated ones (characters, tokens and lines deleted, duplicated and swapped; hostile
snippets inserted), and stirred from Python's vocabulary. They go through parse_spec and
plan_specs (names, pipeline builder, planner), the path load_plans takes, and each planned
pipeline on through emission (its kernels, its module's source, compiled by Python), where a plan
the stages cannot write crashes (issue 36: a MakeExtraOutput right before a norm that a Dropout
follows). Seeds are fixed, so a failure names a text that reproduces. Each test also asserts
that both outcomes occur often, so it cannot pass by erroring on everything or by accepting
everything (the ops around norms, all valid pipelines, must all give plans). The whole file takes
about 40 CPU-seconds; libcst's reading and the emission are most of it.
"""

from __future__ import annotations

import random
import re
import traceback
from collections import Counter
from pathlib import Path

import pytest

from fusegen import emit, fusion_rules
from fusegen.ops import OPS, REQUIRED
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from fusegen.names import NameTable
from fusegen.build import collect_kernels, plan_specs

SPECS = Path(__file__).resolve().parents[2] / "specs"
SHIPPED = [path.read_text(encoding="utf-8") for path in sorted(SPECS.glob("*.py"))]


# --- the property -------------------------------------------------------------------------------

def file_lines(text: str) -> list[str]:
    """The file's lines as Python counts them (a final newline ends the last line, adds none)."""
    lines = re.split(r"\r\n|\r|\n", text)
    return lines[:-1] if len(lines) > 1 and lines[-1] == "" else lines


def outcome(files: list[tuple[str, str]]) -> str:
    """'plans' or 'error' for spec files (display name, text) of one build; anything else fails."""
    names = NameTable()
    try:
        for display, text in files:
            plans = plan_specs(parse_spec(text, display), names, fusion_rules.FORWARD_RULES,
                               fusion_rules.BACKWARD_RULES)
            # stages both ways, but for a pipeline of only Identity ops (no op: the module returns x)
            assert plans and all((p.forward and p.backward) or not p.pipeline.ops for p in plans)
            emitted(plans)
        return "plans"
    except SpecError as err:
        texts = dict(files)
        loc = err.location
        assert loc is not None and loc.file in texts, f"error outside the files: {err!r}"
        lines = file_lines(texts[loc.file])
        assert 1 <= loc.line <= len(lines) and loc.col >= 1, f"location {loc} outside the file: {err}"
        assert loc.source_line == lines[loc.line - 1], f"{loc}: quoted line is not line {loc.line}"
        assert str(err).startswith(f"{loc}: error: ")
        return "error"


def emitted(plans) -> None:
    """Each plan's kernels and module source, as a build writes them (emit.pipeline_context is
    the plan.md's context too); the source must be Python."""
    _, per_plan = collect_kernels(plans)
    template = emit.environment().get_template("pipeline.py.j2")
    for plan in plans:
        source = template.render(**emit.pipeline_context(plan, per_plan[plan.pipeline.name]))
        compile(source, f"{plan.pipeline.name}.py", "exec")


def run_all(cases: list[list[tuple[str, str]]], what: str) -> Counter:
    counts: Counter = Counter()
    for index, files in enumerate(cases):
        try:
            counts[outcome(files)] += 1
        except BaseException as exc:  # noqa: BLE001 - the text is the useful part of the report
            shown = "\n".join(f"--- {name}\n{text[:3000]!r}" for name, text in files)
            raise AssertionError(f"{what} case {index} raised {type(exc).__name__}: {exc}\n{shown}\n"
                                 f"{traceback.format_exc()}") from None
    return counts


def assert_both_outcomes(counts: Counter, total: int, at_least: float) -> None:
    print(f"{total} cases: {counts['plans']} gave plans, {counts['error']} a SpecError")  # shown with pytest -s
    assert sum(counts.values()) == total
    assert counts["plans"] >= at_least * total and counts["error"] >= at_least * total, dict(counts)


# --- random specs from the registry -------------------------------------------------------------

# the ops the headers' modules (TE's, fusegen.eager) export; torch.nn's spellings are tested apart.
# (TE's modules, te.LayerNormMLP, ..., have no te.ops spelling: tests/ops/test_te_modules.py)
TE_OPS = [name for name, op in OPS.items() if "fusegen.eager" in op.modules and "transformer_engine.pytorch.ops" in op.modules]
HEADERS = [  # (import lines, prefix of every op call)
    ("import transformer_engine.pytorch as te\n", "te.ops."),
    ("from transformer_engine.pytorch import ops\n", "ops."),
    ("import fusegen.eager as fg\n", "fg."),
    ("from fusegen.eager import *\n", ""),
    (f"from fusegen.eager import {', '.join(['Sequential', *TE_OPS])}\n", ""),
    (f"from transformer_engine.pytorch.ops import (\n    {', '.join(['Sequential', *TE_OPS])},\n)\n", ""),
]
NAMES = ["m", "mlp", "block", "fc1", "fc_2", "MlpBlock", "ffn_in", "p"]
ODD_NAMES = ["_", "_0", "__init__", "_runtime", "kernels", "Mlp", "mlp__block", "mlp_block", "\ufb01", "\u2115",
             "\u01c6", "a" * 70, "con", "match", "type", "print", "x\u0301", "__main__", "Sequential"]
INT_EDGES = [
    "0", "-1", "1", "3", "65535", "65536", "65537", "2 ** 24", "2 ** 24 + 1", "2 ** 62", "2 ** 256", "2 ** 257",
    "10 ** 300", "1" * 400, "1" * 5000, "0x" + "f" * 80, "0b1_0", "0o17", "1_024", "4.0", "8 / 2", "8 // 0", "7 % 0",
    "True", "None", "'4'", "H", "H * 2", "-H", "UNDEFINED", "cfg.h", "[4]", "len('ab')", "4 if 1 else 2", "(K := 4)",
    "*args", "4j", "(-8) ** 0.5", "2 ** -1", "1e999", "1e308 * 10", "10 ** 10 ** 10", "(" * 60 + "4" + ")" * 60,
    "(" * 300 + "4" + ")" * 300, "+".join(["1"] * 60), "+".join(["1"] * 3000), "-" * 60 + "4", "- " * 4000 + "4",
    "f(" * 60 + ")" * 60, "\u0661",
]
FLOAT_EDGES = [
    "0", "0.0", "-1.0", "1e-300", "1e-40", "1e39", "1e308 * 10", "1e308 * 10 - 1e308 * 10", "1e999", "-1e999",
    "2", "True", "None", "EPS", "1 / 3", "1 / 0", "2 ** 1024", "2.0 ** 1024", "10 ** 400", "3.4e38", "-3.5e38",
    "1e-5", "0.5", "(" * 60 + "0.5" + ")" * 60,
]
BOOL_EDGES = ["True", "False", "1", "0", "None", "not True", "USE"]
SHAPE_EDGES = INT_EDGES + ["(64,)", "(8, 64)", "()", "[64]", "('64',)", "(True,)", "'64'"]
GROUP_EDGES = ["None", "tp_group", "group.of(2)", "4", "'g'"]  # any expression: the group is given at run time
DIMS_EDGES = SHAPE_EDGES + ["(-1, 64)", "(-1, -1)", "(64, -1)", "[-1, 2, 32]", "(0, 64)"]
DEVICE_EDGES = ["None", "'cuda'", "'cuda:1'", "'cpu'", "'tpu'", "''", "0", "torch.float32"]
DTYPE_EDGES = ["None", "torch.bfloat16", "torch.half", "torch.int8", "'bf16'", "torch", "float", "1"]
STR_EDGES = ["'tanh'", "'none'", "''", "None", "1", "'tanh' * 2", "f'{H}'", "b'tanh'"]
CONSTANTS = [
    "H = {h}\n", "F = H * 4\n", "EPS = 1e-6\n", "USE = True\n", "H += 0\n", "H: int = {h}\n", "del H\nH = {h}\n",
    "import torch\nX = torch.ones(1)\n", "def f():\n    return 1\n", "x = y = 3\n", "x.y = 3\n",
    "try:\n    import transformer_engine.pytorch as te\nexcept ImportError:\n    te = None\n",
]
ODD_CONSTANTS = [
    "K = (H := {h})\n", "A, B = 1, 2\n", "if True:\n    H = {h}\n", "H = {h} * 1.0\n", "H = 10 ** 100\n", "H = 1e999\n",
    "H = 2 ** 24 * 2\n", "H = H\n", "del H\n", "print(Y := 1)\n", "[H] = [{h}]\n", "H //= 0\n",
]
SIZING = [name for name in TE_OPS if OPS[name].kind in ("linear", "container", "bias", "norm")]


def edge_value(rng: random.Random, kind: str) -> str:
    return rng.choice({"int": INT_EDGES, "float": FLOAT_EDGES, "bool": BOOL_EDGES, "shape": SHAPE_EDGES,
                       "device": DEVICE_EDGES, "dtype": DTYPE_EDGES, "str": STR_EDGES, "dims": DIMS_EDGES,
                       "group": GROUP_EDGES}[kind])


OPTIONAL = {"eps": ["1e-6", "1e-5", "0.001"], "zero_centered_gamma": ["True", "False"], "bias": ["True", "False"],
            "in_place": ["False"]}


def op_call(rng: random.Random, prefix: str, name: str, width: int, corrupt: float) -> tuple[str, int]:
    """A call of registered op ``name`` that fits input ``width``, and its output width; with
    probability ``corrupt`` per argument an edge value replaces the sane one."""
    op = OPS[name]
    out = width
    sane: dict[str, str] = {}
    if op.kind in ("linear", "container"):
        out = rng.choice([width, 2 * width, max(1, width // 2)])
        sane = {"in_features": str(width), "out_features": str(out)}
    elif op.kind in ("bias", "norm"):
        sane = {"size": str(width), "normalized_shape": str(width)}
    elif op.kind == "glu":
        out = width // 2
    elif op.kind == "reshape":
        sane = {"shape": f"(-1, {width})"}
    elif op.kind == "attention":  # heads of 64 (8 at width 8), the sizes its kernels take; one kv head
        out = width
        sane = {"hidden": str(width), "heads": str(max(1, width // 64)), "kv_heads": "1"}
    args, keyword = [], False
    for a in op.args:
        if a.default is REQUIRED:
            value = sane.get(a.name, "4")
        else:  # optional arguments: mostly left at their defaults
            # (an op's own optional argument without a row here gets its default, spelled out)
            value = rng.choice(OPTIONAL.get(a.name, [repr(a.default)])) if rng.random() < 0.3 else None
        if rng.random() < (corrupt / 4 if a.te_only else corrupt):  # TE-only arguments: rarely written at all
            value = edge_value(rng, a.kind)
        if value is None:
            continue
        keyword = keyword or a.keyword_only or rng.random() < 0.2  # no positional after a keyword
        args.append(f"{a.name}={value}" if keyword else value)
    if rng.random() < corrupt / 4:  # arity and keyword mistakes
        rng.choice([lambda: args.append("4"), lambda: args.append("bias=False"), lambda: args.append("device='cuda'"),
                    lambda: args.pop() if args else None, lambda: args.append("**kw")])()
    return f"{prefix}{name}({', '.join(args)})", out


def random_pipeline(rng: random.Random, prefix: str, corrupt: float) -> str:
    width = rng.choice([8, 64, 768, 1024, 4096])
    calls = []
    for i in range(rng.randint(1, 5)):
        names = [n for n in TE_OPS if not (OPS[n].kind == "glu" and width % 2)]
        if i == 0 and rng.random() < 0.8:  # an op that fixes the feature size, mostly
            names = SIZING
        call, width = op_call(rng, prefix, rng.choice(names), width, corrupt)
        calls.append(call)
    if rng.random() < corrupt / 2:
        calls = []
    separator = rng.choice([", ", ",\n    "])
    return f"{prefix}Sequential({separator.join(calls)})"


def random_spec(rng: random.Random) -> str:
    header, prefix = rng.choice(HEADERS)
    corrupt = rng.choice([0.0, 0.0, 0.02, 0.1, 0.3])
    text = [header]
    for _ in range(rng.randint(0, 2)):
        constant = rng.choice(ODD_CONSTANTS if rng.random() < corrupt else CONSTANTS)
        text.append(constant.format(h=rng.choice([8, 64, 1024])))
    used: list[str] = []
    for _ in range(rng.choice([1, 1, 2])):
        odd = rng.random() < corrupt
        name = rng.choice(ODD_NAMES if odd else NAMES)
        if name in used and not odd:
            name = f"{name}_{len(used)}"
        used.append(name)
        text.append(f"\n{name} = {random_pipeline(rng, prefix, corrupt)}\n")
    return "".join(text)


# The two longest runs go in thirds (every third text of the same seeded list), so that pytest-xdist's
# workers share them rather than one finishing the suite alone.
PARTS = 3


@pytest.mark.parametrize("part", range(PARTS))
def test_random_specs_from_the_registry(part):
    rng = random.Random(10)
    cases = [[("spec.py", random_spec(rng))] for _ in range(3000)][part::PARTS]
    assert_both_outcomes(run_all(cases, f"random spec (part {part})"), len(cases), 0.25)


def test_one_build_of_two_random_files():
    """Names collide across files too: two files planned with one NameTable."""
    rng = random.Random(11)
    total = 250
    cases = [[("a.py", random_spec(rng)), ("b.py", random_spec(rng))] for _ in range(total)]
    assert_both_outcomes(run_all(cases, "two files"), total, 0.15)


# --- the ops around norms ------------------------------------------------------------------------

# A norm stage starts at a Bias, a Dropout, an AddExtraInput or a MakeExtraOutput before the norm and
# ends at a Dropout after it (fusion_rules/dropout_norm.py), and its backward at the norm: each
# placement of the extra inputs and outputs around it is a different stage to write. Every text
# here is a valid TE pipeline, so each must plan and emit.
NORM_NEIGHBOURS = ["Bias(64)", "Dropout(0.1)", "Dropout(0.0)", "AddExtraInput()", "AddExtraInput(in_place=True)",
                   "MakeExtraOutput()", "ConstantScale(0.5)", "GELU()", "Identity()"]
NORMS = ["LayerNorm(64)", "RMSNorm(64)", "LayerNorm(64, zero_centered_gamma=True)", "RMSNorm(64, eps=1e-6)",
         "L2Normalization()"]
NORM_ENDS = ["", "Linear(64, 64)", "Linear(64, 64, bias=False)", "GELU()"]


def norm_neighbourhood_spec(rng: random.Random) -> str:
    """One to three pipelines of [an op] (ops around)* norm (ops around)* [an op]: up to three ops a
    side, so that two extra inputs or outputs, or one of each, may stand on either side of the
    norm; the pipelines of a file share kernels where their stages match, by name (two different
    kernels under one name are a crash: [MakeExtraOutput] RMSNorm Dropout, issue 36)."""
    text = "import transformer_engine.pytorch as te\n"
    norm = rng.choice(NORMS)  # one norm a file: its pipelines' norm stages often match
    for index in range(rng.randint(1, 3)):
        ops = [rng.choice(NORM_ENDS)]
        ops += [rng.choice(NORM_NEIGHBOURS) for _ in range(rng.randint(0, 3))]
        ops.append(norm)
        ops += [rng.choice(NORM_NEIGHBOURS) for _ in range(rng.randint(0, 3))]
        ops.append(rng.choice(NORM_ENDS))
        text += f"\nm{index} = te.ops.Sequential({', '.join(f'te.ops.{op}' for op in ops if op)})\n"
    return text


def test_ops_around_norms_plan_and_emit():
    rng = random.Random(15)
    total = 400
    cases = [[("spec.py", norm_neighbourhood_spec(rng))] for _ in range(total)]
    counts = run_all(cases, "ops around a norm")
    assert counts == Counter(plans=total), dict(counts)


# --- mutations of the shipped specs -------------------------------------------------------------

CHARS = "()[]{}:=,.+-*/%#'\"\\\n\t _0123456789aeHLSz\u00e9\ufb01\u2115\u00a0\u200b\r\f"
TOKEN = re.compile(r"\w+|\s+|.")
SNIPPETS = [
    "H = (X := 16)\n", "A, B = 1, 2\n", "*A, = 1, 2\n", "[A] = [1]\n", "a = b = 3\n", "x.y = 3\n", "x[0] = 3\n",
    "if True:\n    H = 8\n", "def f():\n    return 1\n", "class C:\n    pass\n", "for i in range(3):\n    pass\n",
    "with open('x') as H:\n    pass\n", "while False:\n    pass\n", "match H:\n    case 1:\n        pass\n",
    "H = " + "(" * 120 + "1" + ")" * 120 + "\n", "H = " + "(" * 30 + "1" + ")" * 30 + "\n",
    "H = " + "+".join(["1"] * 4000) + "\n", "H = " + "-" * 3000 + "1\n", "H = 1" + "0" * 5000 + "\n",
    "H = 1e999\n", "HIDDEN = 2 ** 62\n", "HIDDEN = 10 ** 6\n", "HIDDEN = 1e308 * 10\n", "\ufb01 = 3\n",
    "from fusegen.eager import *\n", "import transformer_engine.pytorch as te\n", "del HIDDEN\n",
    "HIDDEN: int\n", "HIDDEN += 1\n", "HIDDEN //= 0\n", "global HIDDEN\n", "print(Y := 1)\n",
    "f = lambda: te.ops.Sequential()\n", "if True:\n    m = te.ops.Sequential(te.ops.Linear(4, 4))\n",
    "def g():\n    return Sequential(Linear(4, 4))\n", "q = te.ops.Sequential(te.ops.Linear(4, 4)).cuda()\n",
    "\ufeff", "\x00", "\u2028", "# \u00e9\u00e8 comment\n", "    ", "\t", "\\\n", '"""', "'''",
    "_ = te.ops.Sequential(te.ops.Linear(4, 4))\n", "Te_mlp = te.ops.Sequential(te.ops.Linear(4, 4))\n",
    "te__mlp = te.ops.Sequential(te.ops.Linear(4, 4))\n", "\u2115 = te.ops.Sequential(te.ops.Linear(4, 4))\n",
    "kernels = Sequential(Linear(4, 4))\n", "__init__ = Sequential(Linear(4, 4))\n",
]


def mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(9)
        if kind == 0 and text:  # a character: delete, duplicate, replace
            i = rng.randrange(len(text))
            text = rng.choice([text[:i] + text[i + 1:], text[:i + 1] + text[i:],
                               text[:i] + rng.choice(CHARS) + text[i + 1:]])
        elif kind == 1 and len(text) > 1:  # swap two neighbours
            i = rng.randrange(len(text) - 1)
            text = text[:i] + text[i + 1] + text[i] + text[i + 2:]
        elif kind == 2:  # insert a character
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(CHARS) + text[i:]
        elif kind in (3, 4):  # a token: delete, duplicate, swap with the next, replace with an edge value
            tokens = TOKEN.findall(text)
            if tokens:
                i = rng.randrange(len(tokens))
                choice = rng.randrange(4)
                if choice == 0:
                    del tokens[i]
                elif choice == 1:
                    tokens.insert(i, tokens[i])
                elif choice == 2 and i + 1 < len(tokens):
                    tokens[i], tokens[i + 1] = tokens[i + 1], tokens[i]
                else:
                    tokens[i] = edge_value(rng, rng.choice(["int", "float", "bool"]))
                text = "".join(tokens)
        elif kind == 5:  # a line: delete, duplicate, swap with the next
            lines = text.splitlines(keepends=True)
            if lines:
                i = rng.randrange(len(lines))
                choice = rng.randrange(3)
                if choice == 0:
                    del lines[i]
                elif choice == 1:
                    lines.insert(i, lines[i])
                elif i + 1 < len(lines):
                    lines[i], lines[i + 1] = lines[i + 1], lines[i]
                text = "".join(lines)
        elif kind in (6, 7):  # a hostile snippet at a line start
            starts = [0] + [m.end() for m in re.finditer("\n", text)]
            i = rng.choice(starts)
            text = text[:i] + rng.choice(SNIPPETS) + text[i:]
        else:  # line endings and indentation
            text = rng.choice([text.replace("\n", "\r\n"), text.replace("\n", "\r"), text.replace("    ", "\t"),
                               "    " + text, text + rng.choice(SNIPPETS)])
    return text


@pytest.mark.parametrize("part", range(PARTS))
def test_mutated_shipped_specs(part):
    rng = random.Random(12)
    cases = [[("spec.py", mutate(rng, rng.choice(SHIPPED)))] for _ in range(3000)][part::PARTS]
    assert_both_outcomes(run_all(cases, f"mutated shipped spec (part {part})"), len(cases), 0.2)


def test_mutated_random_specs():
    rng = random.Random(13)
    total = 2000
    cases = [[("spec.py", mutate(rng, random_spec(rng)))] for _ in range(total)]
    # about a tenth give plans: since a misspelt or unimported Sequential beside another pipeline
    # is an error (issue 36) rather than a pipeline skipped, 194 of these 2000 (it was 212)
    assert_both_outcomes(run_all(cases, "mutated random spec"), total, 0.08)


# --- token soup: Python's vocabulary in random order ------------------------------------------------

VOCABULARY = [
    "m", "H", "x", "te", "ops", "Sequential", "Linear", "GELU", "SwiGLU", "RMSNorm", "Bias", "ConstantScale", "import",
    "from", "as", "if", "else", "for", "in", "while", "try", "except", "with", "def", "class", "lambda", "return",
    "async", "await", "match", "case", "del", "global", "pass", "not", "and", "is", "(", ")", "[", "]", "{", "}", ",",
    ":", ";", ".", "=", ":=", "+", "-", "*", "**", "/", "//", "%", "@", "->", "==", "+=", "...", "0", "1", "4", "4096",
    "1e-5", "1e999", "0x10", "1_0", "4j", "'s'", '"""doc"""', "f'{x}'", "b'b'", "\n", "\n", "\n", "    ", "\t", " ",
    " ", "#c\n", "\\\n", "\r", "\f", "\u00e9", "\ufb01",
]
SOUP_PREFIX = "import transformer_engine.pytorch as te\nfrom fusegen.eager import *\n"


def test_token_soup():
    rng = random.Random(14)
    total = 2000
    cases = []
    for index in range(total):
        if index % 2:  # a few tokens inside a spec, so the reader gets past the parser more often
            soup = "".join(rng.choice(VOCABULARY) for _ in range(rng.randint(1, 3)))
            base = random_spec(rng)
            at = rng.randrange(len(base) + 1)
            cases.append([("spec.py", base[:at] + soup + base[at:])])
        else:
            soup = "".join(rng.choice(VOCABULARY) for _ in range(rng.randint(1, 30)))
            cases.append([("spec.py", SOUP_PREFIX + soup)])
    assert_both_outcomes(run_all(cases, "token soup"), total, 0.02)  # mostly syntax errors, by design


def test_shipped_specs_pass_unchanged():
    assert run_all([[("spec.py", text)] for text in SHIPPED], "shipped spec") == Counter(plans=len(SHIPPED))
