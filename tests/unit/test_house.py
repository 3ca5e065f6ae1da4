"""The house: every import points down a floor, and no modules import each other in a circle.

The floor order is written here, once (DESIGN §2 describes it). A room is a top-level
package, or a subpackage of ``pipeline``; a module may import from its own room and from
rooms on lower floors, never from its floor or above. Imports inside functions and under
``TYPE_CHECKING`` count: a lazy import up the house is still an upward dependency.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOPS = ("topics", "stages", "pipeline", "bench")
FLOORS: tuple[tuple[str, ...], ...] = (
    ("topics",),
    ("stages",),
    ("pipeline.process", "pipeline.models", "pipeline.api"),
    ("pipeline.kafka", "pipeline.dataplane", "pipeline.samples", "pipeline.auth"),
    ("pipeline.replay", "pipeline.stagehost"),
    ("pipeline.trainer", "pipeline.worker"),
    ("pipeline.gateway",),
    ("pipeline.run",),
    ("pipeline.inspect",),
    ("pipeline.commands", "bench"),  # the verbs and the benchmarks: neither imports the other
    ("pipeline",),  # cli.py: loads the verbs and (by entry point) the benchmarks
)


def modules(root: Path) -> dict[str, Path]:
    """Every module of the house under ``root`` by its dotted name."""
    found: dict[str, Path] = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pipeline" and len(parts) > 1 and parts[1] != "cli":
        return ".".join(parts[:2])
    return parts[0]


def imported(path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The house's modules that ``path`` imports, anywhere in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                yield name


def upward_imports(root: Path) -> list[str]:
    """``importer -> imported`` for every import of a room on the importer's floor or above."""
    floor = {name: level for level, rooms in enumerate(FLOORS) for name in rooms}
    known = modules(root)
    found = []
    for module, path in known.items():
        here = room(module)
        for target in imported(path, known):
            there = room(target)
            if there != here and floor[there] >= floor[here]:
                found.append(f"{module} -> {target}")
    return found


def import_cycles(root: Path) -> list[list[str]]:
    """The circles of modules that import each other (a package's own ``__init__`` excluded)."""
    known = modules(root)
    graph = {
        module: {t for t in imported(path, known) if t != module and not module.startswith(t + ".")}
        for module, path in known.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def test_every_room_has_a_floor() -> None:
    rooms = {room(module) for module in modules(REPO)}
    placed = {name for rooms_ in FLOORS for name in rooms_}
    assert rooms == placed, (
        f"rooms without a floor: {rooms - placed}; floors without a room: {placed - rooms}"
    )


def test_every_import_points_down() -> None:
    assert upward_imports(REPO) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert import_cycles(REPO) == []


def copy_of_the_house(destination: Path) -> Path:
    for top in TOPS:
        shutil.copytree(REPO / top, destination / top, ignore=shutil.ignore_patterns("*.pyc", "__pycache__"))
    return destination


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    house = copy_of_the_house(tmp_path)
    records = house / "topics" / "records.py"
    records.write_text(
        records.read_text() + "\n\ndef _up() -> None:\n    from pipeline.kafka.embedded import broker\n"
    )
    sessions = house / "pipeline" / "gateway" / "sessions.py"
    sessions.write_text(sessions.read_text() + "\nfrom pipeline.commands.run import add_parser\n")
    assert upward_imports(house) == [
        "topics.records -> pipeline.kafka.embedded.broker",
        "pipeline.gateway.sessions -> pipeline.commands.run",
    ]


def test_a_circle_is_found(tmp_path: Path) -> None:
    house = copy_of_the_house(tmp_path)
    quotas = house / "pipeline" / "gateway" / "quotas.py"
    quotas.write_text(quotas.read_text() + "\nfrom pipeline.gateway.sessions import Session\n")
    assert import_cycles(house) == [["pipeline.gateway.quotas", "pipeline.gateway.sessions"]]
