"""The compiler never imports torch: plan and generate --check run where torch cannot be imported
(CI also runs `make check-without-torch` from a virtual environment that has no torch)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TORCH = textwrap.dedent("""\
    import sys
    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                raise ImportError("torch is blocked in this test: " + name)
    sys.meta_path.insert(0, BlockTorch())
""")


def run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)


@pytest.mark.parametrize("args", [["generate", "--check"], ["plan", "specs/te_mlp.py"]], ids=["check", "plan"])
def test_compiler_runs_without_torch(args):
    result = run_without_torch("from fusegen.cli import main\nsys.exit(main(sys.argv[1:]))\n", *args)
    assert result.returncode == 0, result.stderr
    assert "torch is blocked" not in result.stderr


def test_registry_imports_without_torch_and_reference_math_imports_it_when_run():
    result = run_without_torch("""
        import fusegen.ops as ops
        import fusegen.build
        source = ops.reference_source()
        assert "torch" not in sys.modules, "importing the registry imported torch"
        try:
            ops.OPS["GELU"].reference[0](1.0)  # a reference function imports torch when it runs
        except ImportError as e:
            assert "torch is blocked" in str(e)
        else:
            raise AssertionError("the lazy torch did not import torch")
        print(len(source))
    """)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0
