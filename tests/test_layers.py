"""The folders are the layers: walk every import of `engine` and `protocol` with `ast` and fail
on an import cycle or on an import that points up a layer.

Function-local imports count like module-level ones (a cycle held together by an import
inside a function is still a cycle); imports under `if TYPE_CHECKING:` do not run and are
left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Layer of a module: the longest prefix below that names it.
LAYER_OF: dict[str, str] = {
    "engine.errors": "facts",
    "engine.languages": "facts",
    "engine.replies": "facts",
    "engine.distribution": "facts",  # what the package ships, how it was installed
    "engine.glossary": "facts",  # glossaries: parsing and matching, no model
    "engine.model": "model",
    "engine.decoding": "decoding",
    "engine.streaming": "streaming",
    "engine.evaluation": "evaluation",
    "engine.logs": "logs",
    "engine.hub": "hub",
    "engine.conversion": "conversion",
    "engine.asr": "asr",  # speech: audio sources, the recognizer seam and its adapters, the pool
    "engine.server": "io",
    "engine.cli": "io",
    "engine.replay": "io",
    "engine.remote": "io",
    "engine.reconnect": "io",
    "engine.sender": "io",
    "engine.bridges": "io",
    "engine.subtitles": "io",
    "engine": "facade",  # engine/__init__.py: the public names, loaded on first use
}

# What each layer may import (besides itself and `protocol`, which depends on nothing).
MAY_IMPORT: dict[str, set[str]] = {
    "facts": set(),
    "model": {"facts"},
    "decoding": {"facts", "model"},
    "streaming": {"facts", "model", "decoding"},
    "evaluation": {"facts"},
    "logs": {"facts", "evaluation"},
    "hub": {"facts", "model"},
    "conversion": {"facts", "model", "decoding"},
    "asr": {"facts"},
    "io": {
        "facts",
        "model",
        "decoding",
        "streaming",
        "evaluation",
        "logs",
        "hub",
        "conversion",
        "asr",
    },
}


MAY_IMPORT["facade"] = {*MAY_IMPORT["io"], "io"}  # engine/__init__.py re-exports any layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    files = [*ROOT.joinpath("engine").rglob("*.py"), *ROOT.joinpath("protocol").rglob("*.py")]
    return {module_name(path): path for path in files}


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            yield from _imports(ast.Module(body=node.orelse, type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (a `from package import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        found.update(target for target in targets if target in known and target != name)
    return found


def graph() -> dict[str, set[str]]:
    modules = source_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def layer(module: str) -> str | None:
    if module == "protocol" or module.startswith("protocol."):
        return "protocol"
    best = max(
        (prefix for prefix in LAYER_OF if module == prefix or module.startswith(prefix + ".")),
        key=len,
        default=None,
    )
    return LAYER_OF[best] if best is not None else None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = [name for name in source_modules() if layer(name) is None]
    assert not unplaced, f"modules in no layer (add them to LAYER_OF): {unplaced}"


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_never_point_up_a_layer() -> None:
    wrong = []
    for importer, targets in graph().items():
        mine = layer(importer)
        for target in sorted(targets):
            theirs = layer(target)
            if mine == "protocol":
                if theirs != "protocol":
                    wrong.append(f"{importer} -> {target} (protocol depends on nothing)")
            elif theirs not in ("protocol", mine) and theirs not in MAY_IMPORT[str(mine)]:
                wrong.append(f"{importer} ({mine}) -> {target} ({theirs})")
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_the_walk_finds_cycles_and_upward_imports(tmp_path: Path) -> None:
    """The checks above can fail: the same walk on a made-up pair of modules."""
    edges = {"engine.model.a": {"engine.model.b"}, "engine.model.b": {"engine.model.a"}}
    assert cycles(edges) == [["engine.model.a", "engine.model.b"]]
    source = tmp_path / "x.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import engine.streaming.session\n"
        "def f():\n    from engine.decoding import scheduler\n"
    )
    known = {"engine.decoding", "engine.decoding.scheduler", "engine.streaming.session"}
    assert imports_of("engine.model.x", source, known) == {"engine.decoding.scheduler"}
    assert layer("engine.decoding.scheduler") not in MAY_IMPORT["model"]
