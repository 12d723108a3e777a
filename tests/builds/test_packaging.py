"""The distribution installs one top-level package, fusegen (generator/, fusion_rules/ and
templates/ mapped into it), and an installed wheel finds its templates and compiles a plan."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_holds_only_fusegen_and_works_installed(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("fusegen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"fusegen"}
    assert "fusegen/templates/cuda/norm.cuh" in names and "fusegen/fusion_rules/__init__.py" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    spec = tmp_path / "mlp.py"
    spec.write_text("import transformer_engine.pytorch as te\nmlp = te.ops.Sequential(te.ops.RMSNorm(64), te.ops.GELU())\n")
    code = ("import sys; from fusegen import emit; print(emit.TEMPLATES); "
            "from fusegen.cli import main; sys.exit(main(['plan', 'mlp.py']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(target)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == str(target / "fusegen" / "templates")
    assert "| `RMSNorm(64)` |" in result.stdout and "`norm`: row-norm kernel" in result.stdout
