"""Every benchmark measures the engine of the checkout it is run from.

The project is installed editable (`.ci/run`), and an editable install's import hook
answers for `engine` whenever `sys.path` does not. A script run as
`python examples/benchmarks/x.py` has its own folder first on `sys.path`, not the
checkout's root: without putting the root there itself, a benchmark run from a second
checkout (a git worktree of the code before a change, the usual before/after setup)
silently measures the installed checkout instead, and before equals after.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "examples" / "benchmarks"
ROOT_EXPR = "Path(__file__).resolve().parents[2]"


def _imports_project(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] in ("engine", "protocol")
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in ("engine", "protocol") for a in node.names)
    return False


def _root_insert(node: ast.AST, roots: set[str]) -> bool:
    """Whether `node` is `sys.path.insert(0, str(<the checkout's root>))`."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    call = node.value
    if ast.unparse(call.func) != "sys.path.insert" or len(call.args) != 2:
        return False
    where = call.args[1]
    if not (isinstance(where, ast.Call) and ast.unparse(where.func) == "str"):
        return False
    inner = ast.unparse(where.args[0])
    return inner in roots or inner == ROOT_EXPR


def _scripts() -> list[Path]:
    return sorted(
        p
        for p in BENCHMARKS.glob("*.py")
        if any(_imports_project(n) for n in ast.walk(ast.parse(p.read_text())))
    )


def test_the_benchmarks_that_import_the_engine_are_found() -> None:
    names = {p.name for p in _scripts()}
    assert {"capacity.py", "decode_speed.py", "step_anatomy.py"} <= names


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: p.name)
def test_a_benchmark_puts_its_checkout_first_before_importing_the_engine(
    script: Path,
) -> None:
    tree = ast.parse(script.read_text())
    roots = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == ROOT_EXPR
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    # The first module-level import of the project must come after the root's insert;
    # an import inside a function needs an insert somewhere (module level, or in the
    # script's main before it calls that function).
    inserted = False
    for node in tree.body:
        if _root_insert(node, roots):
            inserted = True
        elif _imports_project(node):
            assert inserted, f"{script.name}: imports the project before its root is on sys.path"
    assert any(_root_insert(n, roots) for n in ast.walk(tree)), (
        f"{script.name}: never puts its checkout's root on sys.path"
    )
