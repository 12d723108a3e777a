"""generator/'s modules as a whole: none imports another that imports it back, directly or through
others, and none is over MAX_LINES lines.

An import is any import statement of a module, inside a function too (it runs when the function
does), except one under ``if TYPE_CHECKING:`` (annotations only, never run). ``from .x import y``
imports the module x.y when there is one, else x.
"""

import ast
import textwrap
from pathlib import Path

import pytest

GENERATOR = Path(__file__).resolve().parents[1] / "generator"
PACKAGE = "fusegen"  # generator/'s import name
MAX_LINES = 350


def module_files(root: Path, package: str) -> dict[str, Path]:
    """{dotted name: file} of every module under ``root``, a folder imported as ``package``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join((package, *parts[:-1 if parts[-1] == "__init__" else None]))] = path
    return modules


def _under_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (in ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    pending: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while pending:
        node = pending.pop()
        if _under_type_checking(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up for each dot after the first
                parent = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:  # `import fusegen.x.y` imports x.y
                dotted = alias.name
                while dotted and dotted not in modules:
                    dotted = dotted.rpartition(".")[0]
                found.add(dotted)
        pending.extend(ast.iter_child_nodes(node))
    return (found & modules.keys()) - {name}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle through each group of modules that import each other (a strongly
    connected component of the graph, Tarjan's algorithm), as [a, b, ..., a] from the group's
    first module by name: the shortest way back to it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = set()
            while module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(shortest_way_back(graph, group, min(group)) for group in groups)


def shortest_way_back(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """The shortest import path from ``start`` back to it within ``group`` (breadth first)."""
    came_from: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        step = []
        for module in frontier:
            for other in sorted(graph[module] & group):
                if other == start:
                    path = [module]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if other not in came_from:
                    came_from[other] = module
                    step.append(other)
        frontier = step
    raise AssertionError(f"{start} does not import itself through {sorted(group)}")


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def test_a_circle_through_a_functions_import_is_found_and_type_checking_imports_are_not_followed(tmp_path):
    root = write_package(tmp_path / "p", {
        "__init__.py": "",
        "a.py": "from . import b\nfrom .d import helper\n",
        "b.py": "def later():\n    from .sub.c import x\n",
        "sub/__init__.py": "",
        "sub/c.py": "import p.a\n",
        "d.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .a import Thing
            else:
                from .sub import c
            """,
    })
    graph = import_graph(root, "p")
    assert graph == {"p": set(), "p.a": {"p.b", "p.d"}, "p.b": {"p.sub.c"}, "p.sub": set(),
                     "p.sub.c": {"p.a"}, "p.d": {"p.sub.c"}}
    assert circles(graph) == [["p.a", "p.b", "p.sub.c", "p.a"]]
    (root / "d.py").write_text("from . import a\n")  # a second circle through p.a, the shorter way back
    assert circles(import_graph(root, "p")) == [["p.a", "p.d", "p.a"]]


def test_no_module_of_generator_imports_itself_through_others():
    found = circles(import_graph(GENERATOR, PACKAGE))
    assert not found, "import circles in generator/: " + "; ".join(" -> ".join(circle) for circle in found)


def test_no_module_of_generator_is_over_the_line_limit():
    over = {name: n for name, path in module_files(GENERATOR, PACKAGE).items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not over, f"modules of generator/ over {MAX_LINES} lines: " + ", ".join(
        f"{name} ({n})" for name, n in sorted(over.items()))
