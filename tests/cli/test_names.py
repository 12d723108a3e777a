"""Pipeline names: each becomes a module file and a class of the generated package (generator/names.py)."""

import pytest

from fusegen import fusion_rules
from fusegen.build import load_plans
from fusegen.config import Config
from fusegen.errors import Location, SpecError
from fusegen.frontend import parse_spec
from fusegen.names import MAX_NAME_LENGTH, NameTable, check_name, class_name
from fusegen.pipeline import build_pipeline
from fusegen.build import plan_specs
from spec_errors import assert_points_at

EAGER = "from fusegen.eager import Sequential, Linear\n"


@pytest.mark.parametrize("name,cls", [
    ("mlp_block", "MlpBlock"), ("te_mlp", "TeMlp"), ("fc1", "Fc1"), ("mlp__block_", "MlpBlock"), ("_mlp", "Mlp"),
    ("MLP", "MLP"), ("a_0", "A0"),
])
def test_class_names(name, cls):
    assert class_name(name) == cls
    (spec,) = parse_spec(EAGER + f"{name} = Sequential(Linear(4, 4))\n", "spec.py")
    assert build_pipeline(spec).class_name == cls


@pytest.mark.parametrize("name,message", [
    # Python reads identifiers NFKC-normalised, file systems do not: ASCII only, with a suggestion
    ("\ufb01", "pipeline name '\ufb01' is not ASCII; it becomes the module file \ufb01.py and a class name, so use "
              "ASCII letters, digits and underscores, e.g. 'fi'"),
    ("\u2115", "pipeline name '\u2115' is not ASCII; it becomes the module file \u2115.py and a class name, so use "
               "ASCII letters, digits and underscores, e.g. 'N'"),
    ("\u01c6", "e.g. 'dz'"),
    ("caf\u00e9", "e.g. 'cafe'"),
    ("\u03bb", "e.g. 'pipeline'"),  # nothing ASCII in it
    # the class name drops underscores and capitalises each part: it must start with a letter
    ("_", "pipeline name '_' gives the class name '', which is not a Python class name; start the name with a "
          "letter, e.g. 'pipeline_'"),
    ("_0", "pipeline name '_0' gives the class name '0', which is not a Python class name; start the name with a "
           "letter, e.g. 'pipeline_0'"),
    ("__1x", "gives the class name '1x'"),
    ("a" * (MAX_NAME_LENGTH + 1), f"pipeline name 'aaaaaaaaaaaaaaaa...' is {MAX_NAME_LENGTH + 1} characters long; it "
                                  f"becomes a module file name, so keep it to at most {MAX_NAME_LENGTH}"),
    # the package's own modules, and dunder names Python gives a meaning to
    ("_runtime", "pipeline name '_runtime' is taken by the generated package itself (its folder _runtime/); "
                 "rename the pipeline, e.g. 'runtime_block'"),
    ("_kernels", "taken by the generated package itself (its module _kernels.py)"),
    ("_reference", "taken by the generated package itself"),
    ("kernels", "taken by the generated package itself (its folder kernels/)"),
    ("__init__", "taken by the generated package itself (its module __init__.py); rename the pipeline, "
                 "e.g. 'init_block'"),
    ("__main__", "taken by the generated package itself"),
    ("__version__", "pipeline name '__version__' is a dunder name, which Python reserves for itself (as in "
                    "__init__.py and __main__.py); rename the pipeline, e.g. 'version_block'"),
    # file names Windows refuses
    ("con", "pipeline name 'con' would make the module file con.py, which Windows does not allow (CON is a "
            "device name); rename it, e.g. 'con_block'"),
    ("Com1", "Windows does not allow (COM1 is a device name)"),
])
def test_invalid_names_point_at_the_name(name, message):
    source = EAGER + f"x = 1\n{name} = Sequential(Linear(4, 4))\n"
    with pytest.raises(SpecError) as info:
        parse_spec(source, "spec.py")
    assert message in info.value.message
    assert_points_at(info.value, source, 3, 1, name)


@pytest.mark.parametrize("name", ["a" * MAX_NAME_LENGTH, "match", "case", "type", "print", "Sequential", "mlp_",
                                  "_mlp", "kernel", "runtime", "console", "lpt"])
def test_valid_names(name):
    (spec,) = parse_spec(EAGER + f"{name} = Sequential(Linear(4, 4))\n", "spec.py")
    assert spec.name == name


@pytest.mark.parametrize("name,message", [
    ("class", "pipeline name 'class' is a Python keyword, so its module could not be imported; rename it, "
              "e.g. 'class_block'"),
    ("mlp-block", "pipeline name 'mlp-block' is not a Python identifier; use letters, digits and underscores, "
                  "e.g. 'mlpblock'"),
])
def test_names_a_spec_cannot_spell_are_refused_too(name, message):
    # The parser refuses these in a spec; the checks still guard other callers of the API.
    with pytest.raises(SpecError) as info:
        check_name(name, Location("spec.py", 1, 1))
    assert info.value.message == message


@pytest.mark.parametrize("first,second,message", [
    ("mlp_block", "mlp__block", "pipeline 'mlp__block' gives the class name MlpBlock, like pipeline 'mlp_block' "
                                "(line 2); rename one of them so the package can export both"),
    ("mlpBlock", "mlp_block", "pipeline 'mlp_block' gives the class name MlpBlock, like pipeline 'mlpBlock' (line 2)"),
    ("mlp", "Mlp", "pipeline 'Mlp' would be written to Mlp.py, and pipeline 'mlp' (line 2) to mlp.py: one file on "
                   "case-insensitive file systems (macOS, Windows); rename one of them"),
    ("MLP", "mlp", "pipeline 'mlp' would be written to mlp.py, and pipeline 'MLP' (line 2) to MLP.py"),
    ("m", "m", "pipeline 'm' is defined twice in this file (first at line 2); give each pipeline its own name"),
])
def test_collisions_in_one_file_point_at_the_second_name(first, second, message):
    source = EAGER + f"{first} = Sequential(Linear(4, 4))\nH = 4\n  # comment\n{second} = Sequential(Linear(H, 4))\n"
    with pytest.raises(SpecError) as info:
        parse_spec(source, "spec.py")
    assert message in info.value.message
    assert_points_at(info.value, source, 5, 1, second)


def write_specs(tmp_path, **files):
    paths = []
    for name, body in files.items():
        path = tmp_path / f"{name}.py"
        path.write_text(EAGER + body, encoding="utf-8")
        paths.append(path)
    return Config(specs=tuple(paths), out=tmp_path / "out", root=tmp_path)


@pytest.mark.parametrize("second,message", [
    ("mlp", "pipeline 'mlp' is already defined at a.py:2:1; pipeline names become module names and must be unique"),
    ("Mlp", "pipeline 'Mlp' would be written to Mlp.py, and pipeline 'mlp' (a.py:2) to mlp.py: one file on "
            "case-insensitive file systems"),
    ("m_lp", None),
])
def test_collisions_across_the_files_of_one_build(tmp_path, second, message):
    config = write_specs(tmp_path, a="mlp = Sequential(Linear(4, 4))\n",
                         b=f"x = 1\n{second} = Sequential(Linear(4, 4))\n")
    if message is None:  # class MLp, file m_lp.py: no collision
        assert [p.pipeline.name for p in load_plans(config)] == ["mlp", "m_lp"]
        return
    with pytest.raises(SpecError) as info:
        load_plans(config)
    assert message in info.value.message
    loc = info.value.location
    assert (loc.file, loc.line, loc.col, loc.source_line) == ("b.py", 3, 1, f"{second} = Sequential(Linear(4, 4))")


def test_class_collision_across_files_names_the_first_file(tmp_path):
    config = write_specs(tmp_path, a="x = 1\nte_mlp = Sequential(Linear(4, 4))\n",
                         b="te__mlp = Sequential(Linear(4, 4))\n")
    with pytest.raises(SpecError) as info:
        load_plans(config)
    assert str(info.value).startswith("b.py:2:1: error: pipeline 'te__mlp' gives the class name TeMlp, like pipeline "
                                      "'te_mlp' (a.py:3); rename one of them")


def test_plan_specs_claims_names_in_the_table_it_is_given():
    names = NameTable()
    a = plan_specs(parse_spec(EAGER + "mlp = Sequential(Linear(4, 4))\n", "a.py"), names,
                   fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
    assert [p.pipeline.name for p in a] == ["mlp"]
    with pytest.raises(SpecError, match="pipeline 'mlp' is already defined at a.py:2:1"):
        plan_specs(parse_spec(EAGER + "mlp = Sequential(Linear(8, 8))\n", "b.py"), names,
                   fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
