"""Ownership of the output folder: fusegen only replaces or deletes files its own manifest lists,
refuses folders that are not plainly a generated package, and writes every file atomically."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fusegen import build, cli, output
from fusegen.errors import UsageError

SPEC = textwrap.dedent("""\
    from fusegen.eager import Sequential, RMSNorm, GELU
    block = Sequential(RMSNorm(64), GELU())
""")


def generate(tmp_path, out, *extra, spec_text=SPEC, cwd=None):
    spec = tmp_path / "spec.py"
    spec.write_text(spec_text)
    args = ["generate", str(spec), "--out", str(out), "--archs", "sm_90", "--dtypes", "float32", *extra]
    if cwd is None:
        return cli.main(args)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return cli.main(args)
    finally:
        os.chdir(old)


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_user_file_inside_the_output_folder_survives(tmp_path):
    out = tmp_path / "fused"
    assert generate(tmp_path, out) == 0
    (out / "helpers.py").write_text("USER = 1\n")
    (out / "kernels" / "notes.md").write_text("mine\n")
    assert generate(tmp_path, out, "--rebuild") == 0
    assert (out / "helpers.py").read_text() == "USER = 1\n"
    assert (out / "kernels" / "notes.md").read_text() == "mine\n"


def test_file_the_previous_manifest_listed_is_removed(tmp_path):
    out = tmp_path / "fused"
    assert generate(tmp_path, out) == 0
    assert (out / "kernels" / "gelu_fwd_n64.sm_90.cubin").is_file()
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert "kernels/gelu_fwd_n64.sm_90.cubin" in manifest["files"] and "MANIFEST.json" not in manifest["files"]
    assert generate(tmp_path, out, spec_text=SPEC.replace(", GELU())", ")")) == 0
    assert not (out / "kernels" / "gelu_fwd_n64.sm_90.cubin").exists()
    assert not (out / "kernels" / "gelu_fwd_n64.cu").exists()
    assert (out / "kernels" / "rmsnorm_fwd_h64.sm_90.cubin").is_file()


def test_out_dot_in_a_git_repository_is_refused_and_git_is_intact(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "model.py").write_text("x = 1\n")
    before = tree(repo)
    assert generate(tmp_path, ".", cwd=repo) == 2
    err = capsys.readouterr().err
    assert "refusing to write into .: it is the current directory" in err and "Traceback" not in err
    assert tree(repo) == before


@pytest.mark.parametrize("marker", [".git", "pyproject.toml", "setup.py"])
def test_a_project_folder_is_refused(tmp_path, capsys, marker):
    project = tmp_path / "project"
    project.mkdir()
    (project / marker).mkdir() if marker == ".git" else (project / marker).write_text("")
    before = tree(project)
    assert generate(tmp_path, project) == 2
    assert f"it holds {marker}, so it is a project" in capsys.readouterr().err
    assert tree(project) == before


def test_a_folder_holding_the_specs_is_refused(tmp_path, capsys):
    model = tmp_path / "model"
    (model / "specs").mkdir(parents=True)
    spec = model / "specs" / "mlp.py"
    spec.write_text(SPEC)
    (model / "train.py").write_text("print('mine')\n")
    before = tree(model)
    args = ["generate", str(spec), "--out", str(model), "--archs", "sm_90", "--dtypes", "float32"]
    assert cli.main(args) == 2
    assert f"it holds the spec file {spec.as_posix()}" in capsys.readouterr().err
    assert tree(model) == before


def test_a_parent_of_the_working_directory_is_refused(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    assert generate(tmp_path, "..", cwd=tmp_path / "sub") == 2
    assert "it is a parent of the current directory" in capsys.readouterr().err


def test_a_non_empty_folder_without_a_manifest_is_refused(tmp_path, capsys):
    code = tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text("A = 1\n")
    (code / "MANIFEST.json").write_text('{"generator": "something else"}')
    before = tree(code)
    assert generate(tmp_path, code) == 2
    assert "not empty and has no MANIFEST.json written by fusegen" in capsys.readouterr().err
    assert tree(code) == before


def test_an_empty_folder_is_accepted(tmp_path):
    (tmp_path / "empty").mkdir()
    assert generate(tmp_path, tmp_path / "empty") == 0
    assert (tmp_path / "empty" / "block.py").is_file()


def test_out_naming_an_existing_file_is_refused(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("keep\n")
    assert generate(tmp_path, tmp_path / "file.txt") == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "file.txt").read_text() == "keep\n"


def test_a_user_file_with_a_generated_name_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "fused"
    assert generate(tmp_path, out) == 0
    (out / "block.py").unlink()
    manifest = json.loads((out / "MANIFEST.json").read_text())
    manifest["files"].remove("block.py")  # as if an older spec made no `block` pipeline
    (out / "MANIFEST.json").write_text(json.dumps(manifest))
    (out / "block.py").write_text("# the user's own module\n")
    assert generate(tmp_path, out) == 2
    err = capsys.readouterr().err
    assert "refusing to overwrite" in err and "block.py: fusegen did not write it" in err
    assert (out / "block.py").read_text() == "# the user's own module\n"


def test_the_refusal_to_overwrite_comes_before_any_compile(tmp_path, capsys, monkeypatch):
    """A pipeline renamed onto a user's file: refused before NVRTC compiles a kernel (its new
    kernels would take minutes at real sizes), and the folder is left as it was (issue 36)."""
    out = tmp_path / "fused"
    assert generate(tmp_path, out) == 0
    (out / "mlp.py").write_text("# the user's own module\n")
    before, _ = tree(out), capsys.readouterr()
    compiles = []
    monkeypatch.setattr("fusegen.toolchain.jobs.run_compiles", lambda jobs, *rest: compiles.extend(jobs) or {})
    new_spec = SPEC.replace("block = Sequential(RMSNorm(64), GELU())", "mlp = Sequential(RMSNorm(128), GELU())")
    assert generate(tmp_path, out, spec_text=new_spec) == 2
    err = capsys.readouterr().err
    assert err == f"fusegen: error: refusing to overwrite {out / 'mlp.py'}: fusegen did not write it (it is not in " \
                  "MANIFEST.json); move it away or rename the pipeline\n"
    assert compiles == [] and tree(out) == before


def test_an_interrupted_write_leaves_whole_files_and_owns_everything(tmp_path, monkeypatch):
    out = tmp_path / "fused"
    config = build.Config((tmp_path / "spec.py",), out, archs=("sm_90",), dtypes=("float32",), root=tmp_path)
    (tmp_path / "spec.py").write_text(SPEC)
    output.write_package(build.build_package(config), out)
    before = tree(out)
    (tmp_path / "spec.py").write_text(SPEC.replace("GELU", "SiLU"))
    files = build.build_package(config)

    real_replace, calls = os.replace, []

    def interrupted_replace(src, dst):
        calls.append(dst)
        if len(calls) == 4:  # the manifest claim, two files, then Ctrl-C
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(output.os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        output.write_package(files, out)
    monkeypatch.setattr(output.os, "replace", real_replace)
    after = tree(out)
    assert not [name for name in after if name.endswith(".tmp")], "a temporary file was left behind"
    for name, data in after.items():
        if name != "MANIFEST.json":
            assert data in (before.get(name), files.get(name)), f"{name} is neither the old nor the new file"
    claimed = set(json.loads(after["MANIFEST.json"])["files"])
    assert set(after) - {"MANIFEST.json"} <= claimed  # everything present is still fusegen's to clean up
    written, removed = output.write_package(files, out)
    assert "kernels/gelu_fwd_n64.sm_90.cubin" in removed
    assert tree(out) == files


def test_write_is_a_no_op_when_nothing_changed(tmp_path):
    out = tmp_path / "fused"
    assert generate(tmp_path, out) == 0
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert generate(tmp_path, out) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps


def test_check_output_folder_refuses_only_unowned_files(tmp_path):
    out = tmp_path / "fused"
    assert generate(tmp_path, out) == 0
    (out / "extra.py").write_text("")
    output.check_output_folder(out, (tmp_path / "spec.py",), tmp_path, {"block.py", "MANIFEST.json"})
    with pytest.raises(UsageError, match="refusing to overwrite .*extra.py: fusegen did not write it"):
        output.check_output_folder(out, (), tmp_path, {"block.py", "extra.py"})


def test_a_folder_with_the_single_file_runtime_gets_the_runtime_package(tmp_path):
    """An output of a fusegen before the runtime was a package holds ``_runtime.py``, which its
    MANIFEST.json lists: the next run deletes it and writes ``_runtime/``, and the package then
    imports and runs on the new runtime."""
    out = tmp_path / "fused"
    assert generate(tmp_path, out) == 0
    package = {name: data for name, data in tree(out).items() if name.startswith("_runtime/")}
    assert {"_runtime/__init__.py", "_runtime/loading.py", "_runtime/launch.py"} <= set(package)
    # the folder as the previous fusegen left it: one runtime file, listed in the manifest
    manifest = json.loads((out / "MANIFEST.json").read_text())
    manifest["files"] = sorted([name for name in manifest["files"] if name not in package] + ["_runtime.py"])
    (out / "MANIFEST.json").write_text(json.dumps(manifest))
    for name in package:
        (out / name).unlink()
    (out / "_runtime").rmdir()
    (out / "_runtime.py").write_text('"""The single-file runtime of an earlier fusegen."""\n')

    assert generate(tmp_path, out) == 0
    assert not (out / "_runtime.py").exists()
    assert {name: data for name, data in tree(out).items() if name.startswith("_runtime")} == package
    files = json.loads((out / "MANIFEST.json").read_text())["files"]
    assert "_runtime.py" not in files and set(package) <= set(files)
    use = ("import torch, fused\n"
           "y = fused.Block()(torch.randn(3, 64))\n"
           "print(fused._runtime.__file__, tuple(y.shape))\n")
    run = subprocess.run([sys.executable, "-c", use], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(out / "_runtime" / "__init__.py"), "(3,", "64)"]
