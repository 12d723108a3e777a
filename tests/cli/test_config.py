"""[tool.fusegen]: found by searching upward, paths relative to its own folder, validated."""

import textwrap
from pathlib import Path

import pytest

from fusegen.build import load_plans
from fusegen.config import fusegen_table, load_config, split_list
from fusegen.errors import UsageError

SUPPORTED = (75, 80, 86, 89, 90, 100, 120)
SPEC = "from fusegen.eager import Sequential, GELU, Bias\nm = Sequential(Bias(8), GELU())\n"


def project(tmp_path, table: str) -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'user'\n\n" + textwrap.dedent(table))
    (tmp_path / "specs").mkdir(exist_ok=True)
    (tmp_path / "specs" / "mlp.py").write_text(SPEC)
    return tmp_path


def load(cwd, *, specs=(), config=None, out=None, archs=None, dtypes=None, supported=SUPPORTED):
    return load_config(list(specs), config, out, archs, dtypes, supported, cwd=cwd)


def test_the_package_defaults_to_generated_beside_the_pyproject(tmp_path):
    """As the README says: without ``package`` the output is the folder ``generated`` of the
    pyproject.toml's folder, from wherever fusegen runs below it."""
    root = project(tmp_path, """
        [tool.fusegen]
        specs = ["specs/*.py"]
    """)
    (root / "src").mkdir()
    assert load(root / "src").out == root / "generated"


def test_found_from_a_subdirectory_with_paths_relative_to_its_folder(tmp_path):
    root = project(tmp_path, """
        [tool.fusegen]
        specs = ["specs/*.py"]
        package = "model/fused"
        archs = ["sm_90"]
    """)
    deep = root / "src" / "pkg"
    deep.mkdir(parents=True)
    config = load(deep)
    assert config.specs == (root / "specs" / "mlp.py",)
    assert config.out == root / "model" / "fused"
    assert config.archs == ("sm_90",) and config.source == root / "pyproject.toml"


def test_a_nearer_pyproject_without_the_table_is_passed_over(tmp_path):
    root = project(tmp_path, '[tool.fusegen]\nspecs = ["specs/mlp.py"]\n')
    inner = root / "sub"
    inner.mkdir()
    (inner / "pyproject.toml").write_text("[tool.ruff]\nline-length = 100\n")
    assert load(inner).source == root / "pyproject.toml"


def test_command_line_specs_are_relative_to_the_working_directory(tmp_path):
    root = project(tmp_path, '[tool.fusegen]\nspecs = ["specs/mlp.py"]\narchs = ["sm_80"]\n')
    config = load(root / "specs", specs=["mlp.py"], archs="sm_90,compute_80")
    assert config.specs == (root / "specs" / "mlp.py",) and config.archs == ("sm_90", "compute_80")


@pytest.mark.parametrize("table, message", [
    ('specs = "specs/mlp.py"', "specs must be a list of strings (spec files or globs), e.g. specs = [\"specs/*.py\"]; got 'specs/mlp.py'"),
    ('spec = ["specs/*.py"]', "unknown key 'spec'; did you mean 'specs'?"),
    ('colour = "red"', "unknown key 'colour'; known keys: specs, package, archs, dtypes"),
    ("specs = []", "specs is empty; give spec files or globs"),
    ('specs = ["specs/*.py"]\narchs = []', "archs is empty; give GPU targets"),
    ('specs = ["specs/*.py"]\ndtypes = [16]', "dtypes must be a list of strings"),
    ('specs = ["specs/*.py"]\npackage = ["a"]', "package must be a string"),
])
def test_schema_errors_name_the_file_and_the_fix(tmp_path, table, message):
    project(tmp_path, "[tool.fusegen]\n" + table + "\n")
    with pytest.raises(UsageError) as err:
        load(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'pyproject.toml'}: [tool.fusegen]")
    assert message in str(err.value)


def test_malformed_toml_is_a_usage_error_with_its_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.fusegen]\nspecs = [\"a.py\"]\narchs = sm_90\n")
    with pytest.raises(UsageError, match=r"pyproject.toml: not valid TOML: .*line 3, column 9"):
        load(tmp_path)


@pytest.mark.parametrize("archs, dtypes, message", [
    ("", None, "--archs needs a comma-separated list without empty items, got ''"),
    ("sm_90,", None, "without empty items"),
    (None, "", "--dtypes needs a comma-separated list"),
    ("sm_70", None, "arch 'sm_70' is not supported by the pinned NVRTC; it builds sm_75, sm_80"),
    ("sm90", None, "unknown arch 'sm90'; use names like sm_80"),
    (None, "bf16", "unknown dtype 'bf16'"),
    (None, "floa32", "did you mean 'float32'?"),
])
def test_bad_command_line_lists(tmp_path, archs, dtypes, message):
    project(tmp_path, '[tool.fusegen]\nspecs = ["specs/*.py"]\n')
    with pytest.raises(UsageError) as err:
        load(tmp_path, archs=archs, dtypes=dtypes)
    assert message in str(err.value)


def test_arch_in_the_table_is_checked_against_nvrtc(tmp_path):
    project(tmp_path, '[tool.fusegen]\nspecs = ["specs/*.py"]\narchs = ["sm_90", "compute_60"]\n')
    with pytest.raises(UsageError, match=r"\[tool.fusegen\] archs: arch 'compute_60' is not supported"):
        load(tmp_path)


@pytest.mark.parametrize("specs, message", [
    (["nope.py"], "spec file 'nope.py' not found"),
    (["specs"], "spec 'specs' is a folder; name the spec files or a glob like 'specs/*.py'"),
    (["specs/*.txt"], "no spec file matches 'specs/*.txt'"),
])
def test_missing_specs(tmp_path, specs, message):
    project(tmp_path, "")
    with pytest.raises(UsageError) as err:
        load(tmp_path, specs=specs)
    assert message in str(err.value)


def test_no_specs_anywhere(tmp_path):
    with pytest.raises(UsageError, match="no spec files: name them on the command line"):
        load(tmp_path)


def test_explicit_config_must_exist_and_hold_the_table(tmp_path):
    with pytest.raises(UsageError, match="config file other.toml not found"):
        load(tmp_path, config="other.toml")
    (tmp_path / "other.toml").write_text("[tool.black]\n")
    with pytest.raises(UsageError, match=r"other.toml has no \[tool.fusegen\] table"):
        load(tmp_path, config="other.toml")


def test_the_shipped_table_is_valid():
    root = Path(__file__).resolve().parents[2]
    assert set(fusegen_table(root / "pyproject.toml")) == {"specs", "package", "archs", "dtypes", "pipelines"}
    assert load(root).features == (("swiglu_any", (8192,)),)


# --- [tool.fusegen.pipelines.<name>]: sizes a size-generic pipeline is also built for -----------

GENERIC_SPECS = ("from fusegen.eager import Sequential, GELU, Bias, SwiGLU\n"
                 "act = Sequential(GELU())\nglu = Sequential(SwiGLU())\nfixed = Sequential(Bias(8), GELU())\n")


def test_pipeline_features_are_read_sorted_and_deduplicated(tmp_path):
    project(tmp_path, """
        [tool.fusegen]
        specs = ["specs/*.py"]
        [tool.fusegen.pipelines.act]
        features = [4096, 64, 4096]
        [tool.fusegen.pipelines.glu]
        features = [128]
    """)
    (tmp_path / "specs" / "mlp.py").write_text(GENERIC_SPECS)
    config = load(tmp_path)
    assert config.features == (("act", (64, 4096)), ("glu", (128,)))
    plans = {p.pipeline.name: p.pipeline for p in load_plans(config)}
    assert plans["act"].specialise == (64, 4096) and plans["glu"].specialise == (128,)
    assert plans["fixed"].specialise == () and not plans["fixed"].generic


@pytest.mark.parametrize("table, message", [
    ('pipelines = "act"', "pipelines must be a table (per-pipeline settings)"),
    ("[tool.fusegen.pipelines]\nact = 3", "[tool.fusegen].pipelines.act must be a table, e.g. "
                                          "[tool.fusegen.pipelines.act] followed by features = [4096, 8192]"),
    ("[tool.fusegen.pipelines.act]\nfeature = [64]", "pipelines.act has an unknown key 'feature'; did you mean 'features'?"),
    ("[tool.fusegen.pipelines.act]\nfeatures = []", "pipelines.act features must be a non-empty list of sizes"),
    ("[tool.fusegen.pipelines.act]\nfeatures = [0]", "sizes from 1 to 16777216"),
    ('[tool.fusegen.pipelines.act]\nfeatures = ["64"]', "got ['64']"),
    ("[tool.fusegen.pipelines.act]\nfeatures = [true]", "got [True]"),
])
def test_pipeline_table_errors(tmp_path, table, message):
    project(tmp_path, '[tool.fusegen]\nspecs = ["specs/*.py"]\n' + table + "\n")
    with pytest.raises(UsageError) as err:
        load(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'pyproject.toml'}: [tool.fusegen]")
    assert message in str(err.value)


@pytest.mark.parametrize("name, sizes, message", [
    ("ac", "[64]", "[tool.fusegen.pipelines.ac] names no pipeline of the specs; did you mean 'act'?"),
    ("zzz", "[64]", "names no pipeline of the specs; pipelines: act, fixed, glu"),
    ("fixed", "[64]", "[tool.fusegen.pipelines.fixed] features: pipeline 'fixed' (specs/mlp.py:4:9) has a fixed "
                      "input size, 8; features is for pipelines in which no op fixes the size. Remove the table"),
    ("glu", "[64, 7]", "[tool.fusegen.pipelines.glu] features: 7 is not a multiple of 2, which pipeline 'glu' needs"),
])
def test_pipeline_features_are_checked_against_the_specs(tmp_path, name, sizes, message):
    project(tmp_path, f'[tool.fusegen]\nspecs = ["specs/*.py"]\n[tool.fusegen.pipelines.{name}]\nfeatures = {sizes}\n')
    (tmp_path / "specs" / "mlp.py").write_text(GENERIC_SPECS)
    with pytest.raises(UsageError) as err:
        load_plans(load(tmp_path))
    assert message in str(err.value)


def test_split_list_strips_spaces():
    assert split_list("sm_80, sm_90", "--archs") == ("sm_80", "sm_90")


def test_spec_files_named_on_the_command_line_may_leave_out_a_table_s_pipeline(tmp_path):
    """`fusegen generate one.py` builds a part of the project: a table for a pipeline of another
    spec file is for that file; one for a pipeline of one.py is still checked."""
    project(tmp_path, '[tool.fusegen]\nspecs = ["specs/*.py"]\n[tool.fusegen.pipelines.elsewhere]\nfeatures = [64]\n'
                      '[tool.fusegen.pipelines.glu]\nfeatures = [7]\n')
    (tmp_path / "specs" / "mlp.py").write_text(GENERIC_SPECS)
    with pytest.raises(UsageError, match="names no pipeline of the specs"):
        load_plans(load(tmp_path))
    with pytest.raises(UsageError, match="7 is not a multiple of 2"):
        load_plans(load(tmp_path, specs=["specs/mlp.py"]))
