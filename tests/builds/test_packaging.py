"""fusegen as a user installs it: the wheel and the sdist, built from a clean copy of the tree, each
installed into a fresh virtual environment where the installed package is the only fusegen (no
editable install's import finder, no checkout on the path), then used: `fusegen --version`,
`fusegen plan`, `fusegen generate` of a spec, and an import and CPU forward/backward of the result.

The fresh environment gets fusegen's dependencies (libcst, jinja2, the pinned NVRTC toolchain,
torch) from this test environment's site-packages, linked into its own one entry at a time with
every fusegen entry and every `.pth` file left out: the same packages a `pip install` would resolve, without
downloading them again, and without the hooks that made an earlier form of this test pass on a
wheel that lacked fusegen.stages."""

import os
import shutil
import site
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOTS = {"generator": "fusegen", "fusion_rules": "fusegen/fusion_rules", "templates": "fusegen/templates"}
PROBE = "generator/_probe_subpackage"  # a subpackage added to the copy only: discovery must find it

SPEC = textwrap.dedent("""\
    import transformer_engine.pytorch as te

    mlp = te.ops.Sequential(
        te.ops.RMSNorm(64),
        te.ops.Linear(64, 32),
        te.ops.GELU(),
    )
""")

# Run inside the fresh environment: the generated module against float64 math written here.
USE = textwrap.dedent("""\
    import importlib.metadata, sys
    import torch
    import fusegen, pkg

    fusegens = [d for d in importlib.metadata.distributions() if d.metadata["Name"] == "fusegen"]
    assert len(fusegens) == 1, fusegens
    assert fusegen.__file__.startswith(sys.prefix), fusegen.__file__
    torch.manual_seed(0)
    module = pkg.Mlp(dtype=torch.float64)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, 64, dtype=torch.float64, requires_grad=True)
    y = module(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    w, weight, bias = (p.detach().clone().requires_grad_() for p in module.parameters())
    xr = x.detach().clone().requires_grad_()
    normed = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True) + 1e-5) * w
    h = normed @ weight.T + bias
    ref = 0.5 * h * (1 + torch.tanh(0.79788456 * (h + 0.044715 * h**3)))  # TE's tanh GELU, its sqrt(2/pi)
    ref.backward(dy)
    for name, got, want in [("y", y, ref), ("dx", x.grad, xr.grad),
                            *[(n, p.grad, r.grad) for (n, p), r in zip(module.named_parameters(), (w, weight, bias))]]:
        err = (got - want).abs().max().item()
        # float64 roundoff, and TE's backward constant (0.1070322243, 10 digits of 3 * 0.044715 * 0.79788456)
        assert err <= 1e-9 * want.abs().max().item(), (name, err)
    print("forward and backward match", tuple(y.shape))
""")


def _clean_copy(dest: Path) -> Path:
    """The tree's files as a clone has them (tracked, plus new files git does not ignore), and a
    subpackage that no configuration names."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / PROBE).mkdir()
    (dest / PROBE / "__init__.py").write_text('"""Only here to show that package discovery finds new folders."""\n')
    return dest


def _build(kind: str, tree: Path, dist: Path) -> Path:
    if kind == "wheel":
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                        str(tree)], check=True, capture_output=True)
        (built,) = dist.glob("fusegen-*.whl")
    else:
        subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(dist)!r})"],
                       cwd=tree, check=True, capture_output=True)
        (built,) = dist.glob("fusegen-*.tar.gz")
    return built


def _fresh_environment(where: Path) -> Path:
    """A virtual environment with no fusegen, holding this environment's other packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, capture_output=True)
    python = where / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    for folder in [*site.getsitepackages(), site.getusersitepackages()]:
        for entry in sorted(Path(folder).iterdir()) if Path(folder).is_dir() else ():
            name = entry.name.lower()
            if (name.startswith(("fusegen", "__editable__", "_fusegen")) or name.endswith(".pth")
                    or name == "__pycache__" or (purelib / entry.name).exists()):
                continue
            (purelib / entry.name).symlink_to(entry)  # in a site folder, where cuda-pathfinder looks
    return python


def _run(args, cwd, **kwargs):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, **kwargs)


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_installed_package_works_in_a_fresh_environment(kind, tmp_path):
    tree = _clean_copy(tmp_path / "tree")
    built = _build(kind, tree, tmp_path / "dist")
    names = (zipfile.ZipFile(built).namelist() if kind == "wheel"
             else [n.split("/", 1)[1] for n in tarfile.open(built).getnames() if "/" in n])
    if kind == "wheel":
        assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"fusegen"}
        # every folder of the package's source, the probe included, is a folder of the wheel
        for folder, package in PACKAGE_ROOTS.items():
            for path in (tree / folder).rglob("*"):
                if path.is_file() and path.suffix in (".py", ".j2", ".cuh") and "__pycache__" not in path.parts:
                    assert f"{package}/{path.relative_to(tree / folder)}" in names, path.relative_to(tree)
    else:
        assert f"{PROBE}/__init__.py" in names and "templates/cuda/norm.cuh" in names

    python = _fresh_environment(tmp_path / "env")
    install = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                    str(built)], cwd=tmp_path)
    assert install.returncode == 0, install.stderr
    fusegen = tmp_path / "env" / "bin" / "fusegen"
    work = tmp_path / "work"
    work.mkdir()
    (work / "mlp.py").write_text(SPEC)

    version = _run([str(fusegen), "--version"], cwd=work)
    assert (version.returncode, version.stdout.strip()) == (0, "fusegen 0.1.0"), version.stderr
    plan = _run([str(python), "-m", "fusegen", "plan", "mlp.py"], cwd=work)
    assert plan.returncode == 0, plan.stderr
    assert "| `RMSNorm(64)` |" in plan.stdout and "`norm`: row-norm kernel" in plan.stdout
    generate = _run([str(fusegen), "generate", "mlp.py", "--out", "pkg", "--archs", "sm_80", "--dtypes", "float32"],
                    cwd=work)
    assert generate.returncode == 0, generate.stderr
    assert (work / "pkg" / "mlp.py").is_file() and list((work / "pkg" / "kernels").glob("*.sm_80.cubin"))
    use = _run([str(python), "-c", USE], cwd=work)
    assert use.returncode == 0, use.stderr
    assert "forward and backward match (5, 32)" in use.stdout
