"""Every generated autograd.Function has one shape (generator/emit/function.py): its stages in
forward_stages/backward_stages functions of the file, run through the runtime's replay_forward and
replay_backward, a CUDA graph handed in or None. Read from the shipped packages' source (ast)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# every pipeline module (not the module of one built for several tensor-parallel sizes, which only
# chooses among them: tensor_parallel_sizes.py.j2)
FILES = sorted(p for folder in (ROOT / "generated", *ROOT.glob("tests/fixtures/*/generated*"))
               for p in folder.glob("[!_]*.py") if "    tensor_parallel_sizes = {" not in p.read_text())


def functions(tree):
    return [node for node in tree.body if isinstance(node, ast.ClassDef)
            and any(ast.unparse(base) == "torch.autograd.Function" for base in node.bases)]


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_function_runs_its_stages_through_the_replay_functions(path):
    tree = ast.parse(path.read_text())
    top = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    classes = functions(tree)
    assert classes or "def grad_forward" in path.read_text()  # only user modules: no Function
    for cls in classes:
        methods = {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}
        forward, backward = ast.unparse(methods["forward"]), ast.unparse(methods["backward"])
        assert forward.startswith("@staticmethod\ndef forward(ctx, graph, *args):"), cls.name
        stages = [call.args[2].id for call in ast.walk(methods["forward"])
                  if isinstance(call, ast.Call) and ast.unparse(call.func) == "replay_forward"]
        assert len(stages) == 1 and stages[0].startswith("forward_stages") and stages[0] in top, cls.name
        back = stages[0].replace("forward", "backward")
        assert f"replay_backward(ctx, {back}," in backward and back in top, cls.name
        assert "backward_done(ctx)" in backward, cls.name
        (returned,) = [node.value for node in ast.walk(methods["backward"]) if isinstance(node, ast.Return)]
        assert ast.unparse(returned.elts[0]) == "None", cls.name  # no grad for the graph


def test_the_files_are_there():
    assert len(FILES) > 40
