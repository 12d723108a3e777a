"""The head of a package's ``_kernels.py`` (stages/launchers.kernels_module) is family-neutral: each
kernel family adds the names its launchers import from ``_runtime`` (KernelFamily.runtime_names)
and its module constants (its head template, in the order of head_position), so a family that a
plugin or a test registers gets its own into the module without any change to kernels.py.j2."""

import ast
import re
from pathlib import Path

import jinja2
import pytest

from fusegen import emit
from fusegen import kernels as kn
from fusegen.stages.launchers import fixed_sizes, kernels_module

ROOT = Path(__file__).resolve().parents[2]

FAKE_LAUNCHER = '''{#- The test family's launcher: it reads its module constant and passes its key as a pointer. #}


def {{ k.name }}({{ k.args|join(", ") }}):
    """{{ k.summary }}."""
{{- compiled(k, "x") }}
    rows = x.shape[0]
    y = torch.empty_like(x)
    {{ K }}.launch(x.dtype, (FAKE_BLOCKS, 1, 1), (32, 1, 1), {{ abi_args(k, random) }}, x.get_device())
    return y
'''
# Its constant only where the package has a kernel of the family.
FAKE_HEAD = '''{%- if kernels %}
FAKE_BLOCKS = {{ fake_blocks }}  # blocks of a fake launch
{%- endif %}
'''

P = kn.KernelParam
FAKE = kn.make_spec(("fake_n8", "fake_n8"), "fake", "a family of the test's",
                    abi=(P("x", "const T*"), P("key", "const long long*"), P("y", "T*"), P("rows", "int")),
                    operands=("key",), returned=("y",), align=8)
OPS = {"fake_n8": "fake_n8_0123abcd"}


class FakeFamily(kn.KernelFamily):
    name = "fake"
    template = "fake/fake.cu.j2"
    launcher_template = "fake/fake.py.j2"
    head_template = "fake/fake_head.py.j2"
    module_constants = {"fake_blocks": 7}

    def runtime_names(self, spec):
        return (*super().runtime_names(spec), "check_row_input")

    def launcher_io(self, spec):
        return dict(args=["x", "key", "dtype"], outputs=1, random=["key"], types={"dtype": "ScalarType"})


def fake_environment() -> jinja2.Environment:
    """fusegen's templates, and the test family's folder."""
    env = emit.environment()
    fake = jinja2.DictLoader({"fake/fake.py.j2": FAKE_LAUNCHER, "fake/fake_head.py.j2": FAKE_HEAD})
    return env.overlay(loader=jinja2.ChoiceLoader([fake, env.loader]), cache_size=0)


def register_fake(monkeypatch, **attributes) -> FakeFamily:
    """The test's family, registered (after fusegen's) for this test only."""
    family = type("Fake", (FakeFamily,), attributes)()
    monkeypatch.setitem(kn.FAMILIES, "fake", family)
    return family


def head_constants(module: str) -> list[str]:
    """The module constants of the head, in order (up to the first launcher)."""
    head = module.partition("\n_")[0]
    return re.findall(r"^([A-Z][A-Z_]*) = ", head, re.M)


def test_a_registered_family_adds_its_constant_import_and_launcher(monkeypatch):
    register_fake(monkeypatch)
    module = kernels_module(fake_environment(), {"fake_n8": FAKE}, OPS, ("float32",), {})
    ast.parse(module)  # a Python module as it stands
    # its runtime names join every launcher's, sorted: pointer for its random key, and its own
    assert "\nfrom ._runtime import Kernel, check_row_input, pointer, register_op\n" in module
    # its constant after fusegen's families' (head_position 100 by default)
    assert head_constants(module) == ["ELEMENTWISE_SPLITS", "COLUMN_SUM_BLOCK", "FAKE_BLOCKS"]
    assert "\nFAKE_BLOCKS = 7  # blocks of a fake launch\n" in module
    # its launcher, from its own template, reads the constant and passes the key as a pointer
    assert '\n_FAKE_N8 = Kernel("fake_n8", "pppi")\n' in module
    assert ("    _FAKE_N8.launch(x.dtype, (FAKE_BLOCKS, 1, 1), (32, 1, 1), "
            "(x.data_ptr(), pointer(key), y.data_ptr(), rows), x.get_device())\n") in module
    # its custom op's schema from launcher_io: the random key may be None, dtype a ScalarType
    assert ('register_op("fake_n8_0123abcd", "(Tensor x, Tensor? key, ScalarType dtype) -> Tensor", '
            "fake_n8, fake_n8)") in module


def test_a_family_without_kernels_in_the_package_adds_what_its_head_template_writes_for_none(monkeypatch):
    register_fake(monkeypatch)
    module = kernels_module(fake_environment(), {}, {}, ("float32",), {})
    assert head_constants(module) == ["ELEMENTWISE_SPLITS", "COLUMN_SUM_BLOCK"]
    assert "\nfrom ._runtime import Kernel, register_op\n" in module


@pytest.mark.parametrize("position, order", [
    (5, ["FAKE_BLOCKS", "ELEMENTWISE_SPLITS", "COLUMN_SUM_BLOCK"]),
    (15, ["ELEMENTWISE_SPLITS", "FAKE_BLOCKS", "COLUMN_SUM_BLOCK"]),
    (40, ["ELEMENTWISE_SPLITS", "COLUMN_SUM_BLOCK", "FAKE_BLOCKS"]),  # a tie: in registration order
])
def test_the_heads_constants_follow_head_position(monkeypatch, position, order):
    register_fake(monkeypatch, head_position=position)
    module = kernels_module(fake_environment(), {"fake_n8": FAKE}, OPS, ("float32",), {})
    assert head_constants(module) == order


def test_the_launchers_module_and_its_renderer_name_no_familys_constants():
    """What a family writes into the head lives in its folder: kernels.py.j2 and stages/launchers.py
    name neither a family nor a constant of a family's head template."""
    shared = {path: (ROOT / path).read_text() for path in ("templates/kernels.py.j2", "generator/stages/launchers.py")}
    heads = [family for family in kn.FAMILIES.values() if family.head_template]
    assert len(heads) == 4
    for family in heads:
        constants = re.findall(r"^([A-Z][A-Z_]*) = ", (ROOT / "templates" / family.head_template).read_text(), re.M)
        assert constants, family.head_template
        for path, text in shared.items():
            for name in (family.name, *constants, *family.module_constants):
                assert name not in text, f"{path} names {name} of {family.name}"


def test_a_module_constant_is_one_familys(monkeypatch):
    """Launcher templates read every family's module constants by name: a second family may not
    take one."""
    monkeypatch.setattr(kn, "FAMILIES", dict(kn.FAMILIES))
    taken = type("Taken", (FakeFamily,), {"module_constants": {"sums_in_kernel_splits": 1}})()
    with pytest.raises(ValueError, match="kernel family 'fake': its module constant 'sums_in_kernel_splits' is "
                                         "kernel family 'norm_bwd''s; give the constant a name of its own"):
        kn.register_family(taken)
    assert "fake" not in kn.FAMILIES
    kn.register_family(FakeFamily())  # a constant of its own
    assert kn.constant_owner("fake_blocks") == "fake"


ANY = kn.make_spec(("fake_any", "fake_any"), "fake", "a size-generic kernel of the test's family",
                   abi=FAKE.params, operands=("key",), returned=("y",), align=8)


def test_a_family_that_reports_fixed_size_variants_gets_the_dispatch_dicts(monkeypatch):
    """The size-generic -> fixed-size dispatch goes by what a family reports
    (KernelFamily.fixed_size_variant), whatever its kernels' context holds."""
    register_fake(monkeypatch, fixed_size_variant=lambda self, spec: ("fake_any", 8) if spec is FAKE else None)
    specs = {"fake_any": ANY, "fake_n8": FAKE}
    fixed = fixed_sizes(specs)
    assert fixed == {"fake_any": [FAKE]}
    module = kernels_module(fake_environment(), specs, {**OPS, "fake_any": "fake_any_0123abcd"}, ("float32",), fixed)
    ast.parse(module)
    assert "\ndef aligned(*tensors):\n" in module
    assert "\n_FAKE_ANY_FIXED = {8: fake_n8}\n" in module
    # a fixed-size kernel whose size-generic one the package lacks is no variant
    assert fixed_sizes({"fake_n8": FAKE}) == {}


def test_a_family_without_fixed_size_variants_gets_no_dispatch(monkeypatch):
    register_fake(monkeypatch)  # KernelFamily.fixed_size_variant's default: none
    specs = {"fake_any": ANY, "fake_n8": FAKE}
    assert fixed_sizes(specs) == {}
    module = kernels_module(fake_environment(), specs, {**OPS, "fake_any": "fake_any_0123abcd"}, ("float32",), {})
    assert "aligned" not in module and "_FIXED" not in module


def test_the_dispatch_reads_no_familys_kernel_context():
    """kernels.py.j2, build.py and stages/launchers.py read no key of a kernel's context (a
    family's own): the fixed-size dispatch comes from KernelFamily.fixed_size_variant."""
    for path in ("templates/kernels.py.j2", "generator/build.py", "generator/stages/launchers.py"):
        text = (ROOT / path).read_text()
        assert not re.search(r"\bctx(\.\w|\[|\.get)|\bc\.\w", text), path
