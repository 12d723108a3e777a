"""The compiler never imports torch: plan and generate --check run where torch cannot be imported
(CI also runs `make check-without-torch` from a virtual environment that has no torch)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK_TORCH = textwrap.dedent("""\
    import sys
    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                raise ImportError("torch is blocked in this test: " + name)
    sys.meta_path.insert(0, BlockTorch())
    from fusegen.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("args", [["generate", "--check"], ["plan", "specs/te_mlp.py"]], ids=["check", "plan"])
def test_compiler_runs_without_torch(args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *args], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "torch is blocked" not in result.stderr
