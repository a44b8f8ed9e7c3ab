"""The library's import layers, read from the source with `ast` (imports inside functions included): no module imports
itself back through others, the ground floor (the target model, the runtime, the file helpers, the Transformers-version
differences, the drafter's modeling code) imports nothing above it, and the drafter's modeling code, shipped alone in
every checkpoint, nothing of the package outside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from testing_utils import REPO

# source folder -> the name it is imported as (`[tool.setuptools.package-dir]` in pyproject.toml)
PACKAGES = {
    "dflash_hf": "dflash_hf",
    "modeling": "dflash_hf.modeling",
    "trainers": "dflash_hf.trainers",
    "hub_cards": "dflash_hf.hub_cards",
}
GROUND_FLOOR = (
    "dflash_hf.target",
    "dflash_hf.runtime",
    "dflash_hf.fileio",
    "dflash_hf.transformers_compat",
    "dflash_hf.modeling",
)
REMOTE_CODE = "dflash_hf.modeling"


def module_files() -> dict[str, Path]:
    """Every module of the distribution by its import name: the console launcher and the packages (the bundled
    drafters' copies of the remote code left out)."""
    files = {"dflash_hf_launcher": REPO / "dflash_hf_launcher.py"}
    for folder, package in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[0] == "bundled":
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((package, *parts))] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (source `path`) imports: `from package import submodule` names the
    submodule, any other import the innermost known module of its dotted name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[: package.count(".") + 2 - node.level] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for dotted in names:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name:
            found.add(dotted)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others."""
    seen, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    return seen


def on_ground_floor(module: str) -> bool:
    return any(module == floor or module.startswith(f"{floor}.") for floor in GROUND_FLOOR)


def test_the_graph_sees_the_layers(graph):
    assert "dflash_hf.cli" in graph["dflash_hf_launcher"]  # imports inside functions count
    assert "dflash_hf.target.row_exact" in graph["dflash_hf.engine.verification"]
    assert "dflash_hf.modeling.modeling_dflash" in graph["dflash_hf.modeling"]


def test_no_import_cycles(graph):
    cyclic = {module for module in graph if module in reachable(graph, module)}
    assert {module: sorted(graph[module] & cyclic) for module in sorted(cyclic)} == {}


def test_the_ground_floor_imports_nothing_above_it(graph):
    upward = {module: sorted(t for t in targets if not on_ground_floor(t)) for module, targets in graph.items()}
    assert {module: targets for module, targets in upward.items() if on_ground_floor(module) and targets} == {}


def test_the_remote_code_imports_only_itself(graph):
    def inside(module: str) -> bool:
        return module == REMOTE_CODE or module.startswith(f"{REMOTE_CODE}.")

    outside = {
        module: sorted(t for t in targets if not inside(t)) for module, targets in graph.items() if inside(module)
    }
    assert {module: targets for module, targets in outside.items() if targets} == {}


def unit_of(module: str) -> str:
    """The unit of the layer picture a module belongs to: a package of `dflash_hf` or a top-level module."""
    parts = module.split(".")
    if parts[0] == "dflash_hf" and len(parts) > 2:
        return ".".join(parts[:2])
    return module


def picture_unit(name: str) -> str:
    """The module named by an entry of docs/design.md's layer picture (`engine/`, `targets.py`, ...)."""
    special = {"dflash_hf/__init__.py": "dflash_hf", "dflash_hf_launcher": "dflash_hf_launcher"}
    return special.get(name, "dflash_hf." + name.removesuffix("/").removesuffix(".py"))


def test_the_design_documents_picture_is_the_import_graph(graph):
    """Each unit stands one floor above the highest unit it imports, as docs/design.md draws it."""
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))

    def floor(unit: str) -> int:
        return max((floor(t) + 1 for t in units[unit]), default=0)

    text = (REPO / "docs" / "design.md").read_text()
    picture = text.split("this picture (", 1)[1].split("```\n", 2)[1]
    drawn = {}
    for line in picture.splitlines():
        number, *entries = line.split()
        drawn.update(
            {picture_unit(entry): int(number) for entry in entries if entry.endswith((".py", "/", "launcher"))}
        )
    assert drawn == {unit: floor(unit) for unit in units}
