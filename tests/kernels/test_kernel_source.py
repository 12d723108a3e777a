"""A kernel's source (stages/launchers.cuda_source): an elementwise kernel's body is written once, templated
on the dtype (templates/elementwise/*.cu.j2, macro ``shared``), and each dtype's namespace only
instantiates it; the compiled entry points inline it."""

import re
from pathlib import Path

import jinja2
import pytest

from fusegen import build, emit
from fusegen.stages.launchers import cuda_source
from fusegen import kernels as kn
from fusegen.config import load_config

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "generated" / "kernels"


def shipped_specs():
    config = load_config([], None, None, None, None, supported_archs=None, cwd=ROOT)
    unique, _ = build.collect_kernels(build.load_plans(config))
    return list(unique.values())


ELEMENTWISE = [s for s in shipped_specs() if s.family.startswith("elementwise_")]


def namespaces(source: str) -> dict[str, str]:
    return dict(re.findall(r"^namespace (\w+) \{\n(.*?)^\}  // namespace \1$", source, re.S | re.M))


@pytest.mark.parametrize("spec", ELEMENTWISE, ids=[s.name for s in ELEMENTWISE])
def test_an_elementwise_source_writes_its_body_once_and_each_dtype_instantiates_it(spec):
    source = (KERNELS / f"{spec.name}.cu").read_text()
    body, _, _ = source.partition("\nnamespace ")
    # one templated device function, before the namespaces, holds every step and every load
    assert len(re.findall(r"^template <typename T\b.*>\n__device__ __forceinline__ void run\(", body, re.M)) == 1
    steps = [dict(s) for s in spec.ctx["steps"]]
    for step in steps:
        assert f"// step {step['index']}: " in body, step["label"]
    per_dtype = namespaces(source)
    assert sorted(per_dtype) == ["bf16", "fp16", "fp32"]
    for suffix, text in per_dtype.items():
        # the namespace: T (and Math), its constants and the entry point, which only calls run
        # (a size-generic kernel's: run_widest, which picks the vector width)
        call = "run_widest" if spec.ctx["generic"] else "run"
        assert re.search(rf"void __launch_bounds__\({spec.ctx['threads']}\) {spec.name}_{suffix}\(\n[^{{}}]*\) {{\n"
                         rf"  {call}<T, [^>]*>\([^;]*\);\n}}\n$", text), suffix
        assert not re.search(r"// step|fg::load|fg::store|#pragma|\bfor \(", text), suffix


@pytest.mark.parametrize("spec", ELEMENTWISE, ids=[s.name for s in ELEMENTWISE])
def test_every_entry_point_inlines_the_shared_body(spec):
    # the PTX: an entry a dtype and no device function (a call would cost every thread a frame)
    ptx = (KERNELS / f"{spec.name}.compute_80.ptx").read_text()
    entries = re.findall(r"^\.visible \.entry (\w+)\(", ptx, re.M)
    assert entries == [f"{spec.name}_{suffix}" for suffix in ("bf16", "fp16", "fp32")]
    assert not re.search(r"^\.(visible |weak |extern )?\.func\b", ptx, re.M)


def fake_environment(template: str) -> jinja2.Environment:
    env = emit.environment()
    return jinja2.Environment(
        loader=jinja2.ChoiceLoader([jinja2.DictLoader({"fake/fake.cu.j2": template}), env.loader]),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


FAKE = kn.make_spec(("fake_n8", "fake_n8"), "fake", "a family of the test's", align=8)


class FakeFamily(kn.KernelFamily):
    name = "fake"
    template = "fake/fake.cu.j2"


@pytest.fixture(autouse=True)
def fake_family(monkeypatch):
    """The test's family, registered for this test only."""
    monkeypatch.setitem(kn.FAMILIES, "fake", FakeFamily())
DTYPES = ("bfloat16", "float16", "float32")


def test_a_family_without_shared_code_has_a_whole_namespace_a_dtype():
    source = cuda_source(FAKE, DTYPES, fake_environment("using T = {{ ctype }};"))
    assert source.endswith("a namespace each, whose kernels end in its suffix.\n"
                           "\nnamespace bf16 {\nusing T = __nv_bfloat16;\n}  // namespace bf16"
                           "\n\nnamespace fp16 {\nusing T = __half;\n}  // namespace fp16"
                           "\n\nnamespace fp32 {\nusing T = float;\n}  // namespace fp32\n")


def test_a_familys_shared_code_is_written_once_before_the_namespaces():
    template = "{% macro shared() %}\ntemplate <typename T> struct Twice {};\n{% endmacro %}using T = {{ ctype }};"
    source = cuda_source(FAKE, DTYPES, fake_environment(template))
    assert source.count("template <typename T> struct Twice {};") == 1
    assert source.index("struct Twice") < source.index("namespace bf16 {")
    assert namespaces(source) == {"bf16": "using T = __nv_bfloat16;\n", "fp16": "using T = __half;\n",
                                  "fp32": "using T = float;\n"}


def test_shared_code_that_differs_between_dtypes_is_an_internal_error():
    template = "{% macro shared() %}using Wrong = {{ ctype }};{% endmacro %}using T = {{ ctype }};"
    with pytest.raises(AssertionError, match=r"fake/fake\.cu\.j2: the macro shared of fake_n8 differs between dtypes"):
        cuda_source(FAKE, DTYPES, fake_environment(template))
