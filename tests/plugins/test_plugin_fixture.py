"""A plugin in the user's own repository (tests/fixtures/plugin_project): TE's op-fuser guide's
custom op as a fusegen plugin, LearnableScale (a scalar parameter), and a rule that fuses it and a
residual add into a norm kernel. The project's package generates, is current, plans with the plugin's rule (fewer bytes
per token than without it), and matches float64 references on CPU; what the plugin registers lasts
one build, and the plugin imports outside a build too."""

import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import references as R
from fusegen import build, emit, fusion_rules, output, plugins
from fusegen.cli import main
from fusegen.config import Config
from fusegen.ops import OPS
from plugin_references import PIPELINES, PROJECT, import_package


def test_plan_uses_the_plugins_op_and_rule(monkeypatch, capsys):
    monkeypatch.chdir(PROJECT)
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    # the tables of each pipeline's plan.md, without its diagrams
    assert "# Fusion plan: `scaled_mlp`" in out and "```mermaid" not in out
    assert "| 1 | `LearnableScale()` |" in out and "`learnable_scale_add_norm`: " in out
    assert "| 1 | 1, 2 | `elementwise`: one kernel for a run of elementwise ops | `lscale_gelu_fwd_n128` |" in out
    assert "| 1 | 0b, 1, 2 | `elementwise_backward`: " in out and "`bias_lscale_gelu_bwd_n128` + `column_sum_n256` |" in out
    assert "| `Softmax()` |" in out and "`opaque`: " in out and "`opaque_backward`: " in out


def test_checked_in_package_of_the_plugin_project_is_current(monkeypatch, capsys):
    monkeypatch.chdir(PROJECT)
    assert main(["generate", "--check"]) == 0, capsys.readouterr().err


def test_a_plugin_build_leaves_no_trace():
    config = Config(specs=(PROJECT / "specs" / "scaled.py",), out=PROJECT / "generated_ext", archs=(),
                    root=PROJECT, plugins=("fusegen_ext",))
    before_rules = (fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
    plans = build.load_plans(config)
    assert [s.rule.name for s in plans[1].forward] == ["linear_bias", "learnable_scale_add_norm"]
    assert "LearnableScale" not in OPS and "Softmax" not in OPS and "fusegen_ext" not in sys.modules
    assert str(PROJECT) not in sys.path
    assert (fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES) == before_rules
    assert build.load_plans(config)[1].forward[1].rule.name == "learnable_scale_add_norm"  # a second build loads it again


def _generate_cpu_package(tmp_path):
    project = tmp_path / "project"
    shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns("generated_ext", "__pycache__"))
    config = Config(specs=(project / "specs" / "scaled.py",), out=project / "cpu_ext", archs=(),
                    dtypes=("float32",), root=project, plugins=("fusegen_ext",))
    output.write_package(build.build_package(config), config.out)
    return import_package(project, "cpu_ext")


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_plugin_pipelines_match_float64_references_on_cpu(tmp_path, name):
    pkg = _generate_cpu_package(tmp_path)
    cls_name, reference, features = PIPELINES[name]
    module = getattr(pkg, cls_name)()
    R.randomize_(module, torch.Generator().manual_seed(1))
    R.run_and_compare(module, name, (3, 5, features), torch.float32, "cpu", reference=reference)


def test_learnable_scale_parameter_is_a_scalar_and_its_kernels_use_the_plugin_header():
    source = (PROJECT / "generated_ext" / "scaled_mlp.py").read_text()
    assert 'self._modules["1"].scale = torch.nn.Parameter(torch.empty((), device=device, dtype=dtype))' in source
    kernel = (PROJECT / "generated_ext" / "kernels" / "lscale_bwd_n64.cu").read_text()
    assert '#include "learnable_scale.cuh"' in kernel and "const ext::Mul step0{};" in kernel
    assert (PROJECT / "generated_ext" / "kernels" / "learnable_scale.cuh").is_file()
    # the scalar grad: per-block partials, then one fixed-order sum; no column-sum kernel for it
    launchers = (PROJECT / "generated_ext" / "_kernels.py").read_text()
    assert "dscale0 = partials[:, 0:64].sum().to(dy.dtype)  # fixed-order reduction" in launchers


# --- a plugin's mistakes are messages, exit 2 ----------------------------------------------------

def _project_with(tmp_path, module_source, plugins_line='plugins = ["bad_ext"]', spec=None):
    project = tmp_path / "p"
    (project / "specs").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        f'[tool.fusegen]\nspecs = ["specs/*.py"]\npackage = "out"\n{plugins_line}\n')
    (project / "bad_ext.py").write_text(textwrap.dedent(module_source))
    (project / "specs" / "s.py").write_text(spec or textwrap.dedent("""\
        from transformer_engine.pytorch.ops import Linear, Sequential
        m = Sequential(Linear(8, 8))
    """))
    return project


BAD_PLUGINS = [
    ("""\
        from fusegen.plugins import FORWARD, GEMM, Rule, register_rule
        register_rule(Rule("linear_gelu", FORWARD, GEMM, "GEMM + GELU", pattern=("linear", "activation")))
     """, "plugin bad_ext: fusion rule 'linear_gelu' cannot be implemented: it may fuse linear + activation, but a "
          "forward GEMM stage runs only these op chains: linear; linear + bias; linear + scale"),
    ("""\
        from fusegen.plugins import ELEMENTWISE, FORWARD, Rule, register_rule
        register_rule(Rule("r", FORWARD, ELEMENTWISE, "x", pattern=("scale",)), before="elementwize")
     """, "plugin bad_ext: fusion rule 'r': no forward rule is named 'elementwize'; the forward rules are dropout_add_norm, norm_dropout, add_norm"),
    ("""\
        from fusegen.plugins import OpDef, register_op
        register_op(OpDef("Twice", "twice", device_struct="ext::Twice", device_header="twice.cuh"), cuda="cuda")
     """, "plugin bad_ext: op Twice: device header twice.cuh not found in"),
    ("""\
        from fusegen.plugins import OpDef, register_op
        register_op(OpDef("GELU", "activation"))
     """, "plugin bad_ext: op GELU is registered twice"),
    ("""\
        SCALE = 2.0
        from fusegen.plugins import OpDef, register_op
        def twice(x):
            return x * SCALE
        register_op(OpDef("Twice", "twice", reference=(twice, None)))
     """, "plugin bad_ext: Twice: reference function bad_ext.twice reads 'SCALE'"),
    ("""\
        from fusegen.plugins import OpDef, register_op
        def f(x):
            return x
        register_op(OpDef("Half", "half", reference=(f, None), opaque=True))
     """, "plugin bad_ext: op Half: an opaque op runs as its reference math, so it needs a reference forward and "
          "backward and no device functor"),
    ("""\
        import fusegen.plugins
        1 / 0
     """, "plugin bad_ext failed to import: "),
]


@pytest.mark.parametrize("source, message", BAD_PLUGINS, ids=["gemm-rule", "anchor", "header", "twice", "unshippable",
                                                                  "opaque", "bug"])
def test_a_broken_plugin_is_a_message_at_the_plugin(tmp_path, monkeypatch, capsys, source, message):
    monkeypatch.chdir(_project_with(tmp_path, source))
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "Twice" not in OPS and "bad_ext" not in sys.modules


def test_a_bug_in_a_plugin_names_its_file_and_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(_project_with(tmp_path, BAD_PLUGINS[-1][0]))
    assert main(["plan"]) == 2
    assert "bad_ext.py:2: ZeroDivisionError: division by zero" in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [
    ('plugins = ["not_there"]', "plugin not_there not found: [tool.fusegen] plugins names modules importable"),
    ('plugins = ["bad ext"]', "plugins: 'bad ext' is not a module name"),
    ('plugins = "bad_ext"', '[tool.fusegen] plugins must be a list of strings (modules that register ops and fusion '
                              'rules), e.g. plugins = ["mypkg.fusegen_ext"]'),
])
def test_plugin_settings_are_checked(tmp_path, monkeypatch, capsys, line, message):
    monkeypatch.chdir(_project_with(tmp_path, "", plugins_line=line))
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_plugin_op_is_imported_from_the_plugin_not_from_te(tmp_path, monkeypatch, capsys):
    source = """\
        from fusegen.plugins import OpDef, register_op
        register_op(OpDef("Noop", "noop"))
    """
    spec = "from transformer_engine.pytorch.ops import Linear, Noop, Sequential\nm = Sequential(Linear(8, 8), Noop())\n"
    monkeypatch.chdir(_project_with(tmp_path, source, spec=spec))
    assert main(["plan"]) == 2
    assert "unknown op 'Noop' (Noop is not in transformer_engine.pytorch.ops; import it from bad_ext)" \
        in capsys.readouterr().err


def test_the_plugin_imports_outside_a_build_and_a_build_after_still_gets_its_rule():
    """As the README's example says: its ops and rule import by name from the plugin module, in
    any Python (a test, a notebook); the op joins that process's registry but no build, and a
    build after it imports the plugin afresh, so its rule is there. In a process of its own: the
    registry is the process's."""
    script = textwrap.dedent("""\
        import sys
        from pathlib import Path
        import fusegen_ext
        from fusegen_ext import LEARNABLE_SCALE_ADD_NORM, LearnableScale, Softmax
        from fusegen import build, fusion_rules, plugins
        from fusegen.config import Config
        from fusegen.ops import OPS

        assert (LearnableScale.name, Softmax.name, LEARNABLE_SCALE_ADD_NORM.name) == (
            "LearnableScale", "Softmax", "learnable_scale_add_norm")
        assert OPS["LearnableScale"] is LearnableScale
        assert LEARNABLE_SCALE_ADD_NORM not in fusion_rules.FORWARD_RULES  # rules are for builds only
        config = Config(specs=(Path("specs/scaled.py"),), out=Path("unused"), archs=(), root=Path.cwd(),
                        plugins=("fusegen_ext",))
        plans = {plan.pipeline.name: plan for plan in build.load_plans(config)}
        assert [s.rule.name for s in plans["layer_scale"].forward] == ["linear_bias", "learnable_scale_add_norm"]
        assert sys.modules["fusegen_ext"] is fusegen_ext and OPS["LearnableScale"] is LearnableScale
        with plugins.loaded((), Path.cwd()):  # a build without the plugin does not see its op
            assert "LearnableScale" not in OPS
        assert OPS["LearnableScale"] is LearnableScale
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def _pass_bytes(plan, pass_) -> int:
    """The plan's bytes/token over one pass's stages (emit.traffic_cells: what its plan.md shows)."""
    cells = [cell for (cell_pass, _), cell in emit.traffic_cells(plan).items() if cell_pass == pass_]
    assert "—" not in cells
    return sum(int(cell.replace(",", "")) for cell in cells)


def test_the_plugins_rule_moves_fewer_bytes_per_token_than_fusegens_own_rules():
    """layer_scale (Linear, LearnableScale, AddExtraInput, MakeExtraOutput, RMSNorm at 64 features,
    2 bytes a value): the GEMM reads 64 values and writes 64 (256 bytes) either way. With the
    rule, one norm kernel reads the GEMM's output and the residual and writes the sum (handed out)
    and the output, and an fp32 rstd (4 * 128 + 4 = 516). Without it the scale's own kernel reads
    and writes 64 values (256) before fusegen's add + norm kernel (516)."""
    config = Config(specs=(PROJECT / "specs" / "scaled.py",), out=PROJECT / "generated_ext", archs=(),
                    root=PROJECT, plugins=("fusegen_ext",))
    with plugins.loaded(config.plugins, config.root) as ext:
        with_rule = next(p for p in build.plans_with(config, ext) if p.pipeline.name == "layer_scale")
        ext.forward_rules[:] = [r for r in ext.forward_rules if r.name != "learnable_scale_add_norm"]
        without = next(p for p in build.plans_with(config, ext) if p.pipeline.name == "layer_scale")
    assert [s.rule.name for s in with_rule.forward] == ["linear_bias", "learnable_scale_add_norm"]
    assert [s.rule.name for s in without.forward] == ["linear_bias", "elementwise", "add_norm"]
    assert _pass_bytes(with_rule, "forward") == 256 + 516
    assert _pass_bytes(without, "forward") == 256 + 256 + 516
    assert _pass_bytes(with_rule, "inference") < _pass_bytes(without, "inference")
    assert with_rule.backward == without.backward  # the rule is the forward's


def test_ops_lists_the_plugins_ops_where_a_spec_imports_them(monkeypatch, capsys):
    monkeypatch.chdir(PROJECT)
    assert main(["ops"]) == 0
    assert "LearnableScale()\n    y = scale * x, scale a learned scalar  (from fusegen_ext)" in capsys.readouterr().out
    assert "LearnableScale" not in OPS


def test_an_opaque_op_with_a_parameter_runs_its_reference_math_and_gets_its_grads(tmp_path, monkeypatch):
    source = """\
        from fusegen.plugins import Arg, OpDef, Param, register_op

        def colscale(x, w):
            return x * w

        def colscale_bwd(x, dy, w):
            return dy * w, (dy * x).sum(0)

        register_op(OpDef(
            "ColScale", "colscale", args=(Arg("size", "int"),), params=(Param("weight", lambda a: (a["size"],),
            lambda a: "ones"),), fixed_in=lambda a: a["size"], reference=(colscale, colscale_bwd), opaque=True,
            needs_input_in_backward=True,
        ))
    """
    spec = ("from transformer_engine.pytorch.ops import GELU, Sequential\nfrom bad_ext import ColScale\n"
            "m = Sequential(GELU(), ColScale(8), GELU())\n")
    project = _project_with(tmp_path, source, spec=spec)
    config = Config(specs=(project / "specs" / "s.py",), out=project / "out", archs=(), dtypes=("float32",),
                    root=project, plugins=("bad_ext",))
    output.write_package(build.build_package(config), config.out)
    pkg = import_package(project, "out")
    assert "ref.colscale(ref.compute(gelu0_out), ref.compute(colscale1_weight))" in (project / "out" / "m.py").read_text()
    module = pkg.M()
    R.randomize_(module, torch.Generator().manual_seed(2))

    def reference(p, x):
        gelu = torch.nn.functional.gelu
        return (gelu(gelu(x, approximate="tanh") * p["1.weight"], approximate="tanh"),)

    R.run_and_compare(module, "m", (4, 8), torch.float32, "cpu", reference=reference)


def test_a_plugin_op_may_use_a_shipped_functor(tmp_path, monkeypatch, capsys):
    source = """\
        from fusegen.plugins import OpDef, register_op

        def halve(x):
            return x * 0.5

        def halve_bwd(x, dy):
            return dy * 0.5

        register_op(OpDef("Halve", "halve", tag=lambda a: "halve", device_struct="fg::Scale",
                          device_args=lambda a: (0.5,), reference=(halve, halve_bwd)))
    """
    spec = ("from transformer_engine.pytorch.ops import Bias, Sequential\nfrom bad_ext import Halve\n"
            "m = Sequential(Bias(8), Halve())\n")
    monkeypatch.chdir(_project_with(tmp_path, source, spec=spec))
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "| `Halve()` |" in out and "| 0 | 0, 1 | `elementwise`: one kernel for a run of elementwise ops | `bias_halve_fwd_n8` |" in out
