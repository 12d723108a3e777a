"""Kernel names: readable and unchanged up to MAX_KERNEL_NAME characters, cut past it to a prefix
of the op chain + "x" + a hash of the full name + direction and size; the full name is kept in the
.cu header comment and MANIFEST.json. Norm backward names carry no eps (the kernel never reads it)."""

import hashlib
import json
import textwrap

import pytest

from fusegen import build, output
from fusegen import kernels as kn

RUN = ["Bias(64)", "GELU()", "ConstantScale(0.5)", "SiLU()"] * 10  # 40 elementwise ops


def write_spec(tmp_path, body):
    spec = tmp_path / "spec.py"
    spec.write_text("from fusegen.eager import (Sequential, Bias, GELU, ConstantScale, SiLU, RMSNorm, LayerNorm,\n"
                    "                             AddExtraInput, MakeExtraOutput)\n" + textwrap.dedent(body))
    return spec


def kernel_specs(spec, tmp_path):
    config = build.Config((spec,), tmp_path / "out", archs=(), dtypes=("float32",), root=tmp_path)
    return build.collect_kernels(build.load_plans(config))


def test_a_short_name_is_the_full_name():
    assert kn.kernel_name("rmsnorm", "fwd_h64") == ("rmsnorm_fwd_h64", "rmsnorm_fwd_h64")
    assert kn.kernel_name("layernorm_zc", "bwd_h768", "add_dresidual")[0] == "layernorm_zc_bwd_h768_add_dresidual"
    chain = "a" * (kn.MAX_KERNEL_NAME - len("_fwd_n64"))
    assert kn.kernel_name(chain, "fwd_n64")[0] == f"{chain}_fwd_n64"  # exactly at the bound: not cut


def test_a_long_name_is_cut_at_an_underscore_with_a_hash_of_the_full_name():
    chain = "_".join(["bias", "gelu", "scale0p5", "silu"] * 10)
    name, full = kn.kernel_name(chain, "bwd_n64", "from_bias")
    assert full == f"{chain}_bwd_n64_from_bias"
    digest = hashlib.sha256(full.encode()).hexdigest()[:kn.NAME_HASH_CHARS]
    assert name == f"bias_gelu_scale0p5_x{digest}_bwd_n64_from_bias"
    assert len(name) <= kn.MAX_KERNEL_NAME and (chain + "_").startswith(name.split("_x")[0] + "_")
    assert kn.kernel_name(chain, "bwd_n64", "from_bias") == (name, full)  # stable
    assert kn.kernel_name(chain + "_relu", "bwd_n64", "from_bias")[0] != name  # a different run, a different name
    assert kn.kernel_name(chain, "fwd_n64")[0].endswith("_fwd_n64")


def test_a_qualifier_that_leaves_no_room_goes_into_the_hash_only():
    tag = "scale1p2345678901234567em05"  # the longest kind of op tag: a float constant
    name, full = kn.kernel_name("_".join([tag] * 3), "bwd_n16777216", f"from_{tag}")
    assert len(name) <= kn.MAX_KERNEL_NAME and name.startswith("x") and name.endswith("_bwd_n16777216")
    assert full.endswith(f"_bwd_n16777216_from_{tag}")


def test_a_long_elementwise_run_generates_with_bounded_file_names(tmp_path):
    spec = write_spec(tmp_path, f"""\
        long_run = Sequential({", ".join(RUN)})
        norm = Sequential(RMSNorm(64))
    """)
    config = build.Config((spec,), tmp_path / "out", archs=("sm_90",), dtypes=("float32",), root=tmp_path)
    files = build.build_package(config)
    output.write_package(files, config.out)
    manifest = json.loads(files[output.MANIFEST])
    bound = len("kernels/") + kn.MAX_KERNEL_NAME + len(".compute_80.ptx")
    assert all(len(rel) <= bound for rel in files if rel.startswith("kernels/")), max(files, key=len)

    chain = "_".join(["bias_gelu_scale0p5_silu"] * 10)
    cut = {entry["full_name"]: name for name, entry in manifest["kernels"].items() if entry["full_name"] != name}
    assert set(cut) == {f"{chain}_fwd_n64", f"{chain}_bwd_n64_from_bias"}
    for full, name in cut.items():
        assert name.startswith("bias_gelu_scale0p5_") and name.endswith(full[len(chain):])
        source = files[f"kernels/{name}.cu"].decode()
        assert f"// full name: {full}\n" in source.split("#include")[0]  # in the header comment
        assert f"void __launch_bounds__(128) {name}_fp32(" in source  # its function: the cut name's
        assert manifest["kernels"][name]["entries"] == {"fp32": [f"{name}_fp32"]}
        assert manifest["kernels"][name]["specialisation"].startswith(
            "Bias(64), GELU(), ConstantScale(0.5), SiLU(), Bias(64)")
        assert f"def {name}(" in files["_kernels.py"].decode()
    # short names are unchanged, and their header comment has no "full name" line
    assert manifest["kernels"]["rmsnorm_fwd_h64"]["full_name"] == "rmsnorm_fwd_h64"
    assert "full name" not in files["kernels/rmsnorm_fwd_h64.cu"].decode()
    assert {"rmsnorm_fwd_h64", "rmsnorm_bwd_h64", "column_sum_n64", "column_sum_n640"} < set(manifest["kernels"])


def test_two_kernels_with_one_cut_name_are_an_error(tmp_path, monkeypatch):
    spec = write_spec(tmp_path, f"""\
        first = Sequential({", ".join(RUN)})
        second = Sequential({", ".join(RUN[:-1] + ["GELU()"])})
    """)
    assert len(kernel_specs(spec, tmp_path)[0]) == 5  # two fwd, two bwd, one column sum
    monkeypatch.setattr(kn, "NAME_HASH_CHARS", 0)  # as if the two full names' hashes collided
    with pytest.raises(AssertionError, match="two different kernels are both named bias_gelu_scale0p5_silu_"):
        kernel_specs(spec, tmp_path)


def test_norm_backward_names_carry_no_eps(tmp_path):
    spec = write_spec(tmp_path, """\
        plain = Sequential(LayerNorm(64))
        eps = Sequential(LayerNorm(64, eps=1e-6))
        res = Sequential(AddExtraInput(), MakeExtraOutput(), RMSNorm(64, eps=1e-3, zero_centered_gamma=True))
    """)
    unique, per_plan = kernel_specs(spec, tmp_path)
    # the forward's and backward's kernels (the no-grad forward's are the forward's here)
    names = {plan: [k.name for (pass_, _), ks in stages.items() if pass_ != "inference" for k in ks]
             for plan, stages in per_plan.items()}
    assert names["plain"] == ["layernorm_fwd_h64", "layernorm_bwd_h64", "column_sum_n128"]
    assert names["eps"] == ["layernorm_eps1em06_fwd_h64", "layernorm_bwd_h64", "column_sum_n128"]  # one shared bwd
    assert names["res"] == ["add_rmsnorm_zc_eps0p001_fwd_h64", "rmsnorm_zc_bwd_h64_add_dresidual", "column_sum_n64"]
    assert unique["layernorm_bwd_h64"].summary == "LayerNorm(64) backward"
    assert "eps" not in unique["rmsnorm_zc_bwd_h64_add_dresidual"].summary
    assert "eps" not in dict(unique["layernorm_bwd_h64"].context)  # the kernel has no eps to differ in


def test_a_norm_kernel_is_one_with_or_without_an_extra_output_before_the_norm(tmp_path):
    """A MakeExtraOutput before the norm changes no code of the norm's forward kernel, so the
    stages with and without one share it: the kernel's operands are numbered among the ops it
    applies, not the stage's (they were not: two different kernels under one name, an internal
    error, for RMSNorm Dropout beside MakeExtraOutput RMSNorm Dropout; issue 36)."""
    spec = tmp_path / "spec.py"
    spec.write_text(textwrap.dedent("""\
        from fusegen.eager import (Sequential, AddExtraInput, Bias, Dropout, Linear, MakeExtraOutput, RMSNorm)
        plain = Sequential(RMSNorm(64), Dropout(0.3))
        tee = Sequential(Linear(64, 64), MakeExtraOutput(), RMSNorm(64), Dropout(0.3))
        add = Sequential(AddExtraInput(), RMSNorm(64), Dropout(0.3))
        add_tee = Sequential(Bias(64), Dropout(0.1), AddExtraInput(), MakeExtraOutput(), RMSNorm(64), Dropout(0.3))
        add_tee2 = Sequential(Bias(64), Dropout(0.1), AddExtraInput(), RMSNorm(64), Dropout(0.3))
    """))
    unique, per_plan = kernel_specs(spec, tmp_path)
    forward = {plan: next(k.name for (pass_, _), ks in stages.items() if pass_ == "forward" for k in ks
                          if k.family == "norm_fwd") for plan, stages in per_plan.items()}
    assert forward["plain"] == forward["tee"] == "rmsnorm_dropout0p3_fwd_h64"
    assert forward["add"] == "add_rmsnorm_dropout0p3_fwd_h64"
    assert forward["add_tee"] == forward["add_tee2"] == "bias_dropout0p1_add_rmsnorm_dropout0p3_fwd_h64"
    assert unique["rmsnorm_dropout0p3_fwd_h64"].operands == ("seed1",)  # the Dropout: op 1 of the kernel's
    assert unique["bias_dropout0p1_add_rmsnorm_dropout0p3_fwd_h64"].operands == ("bias0", "seed1", "seed3")
