"""No branch on which API a request speaks outside the protocol objects.

Each of the four HTTP APIs is one object in ``pipeline.api.protocols`` that knows
everything that differs between them; everywhere else code holds a protocol and asks
it. A comparison of a dialect value, or of a value with an API's name (``==``, ``!=``,
``is``, ``in``), is a switch that belongs in those objects: this test finds each one in
``pipeline/`` and ``stages/`` and names its file and line.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path
from typing import get_args

from topics.wire import Dialect

REPO = Path(__file__).resolve().parents[2]
SEARCHED = ("pipeline", "stages")
PROTOCOLS_PACKAGE = Path("pipeline", "api", "protocols")
NAMES = frozenset(get_args(Dialect))


def _names_the_api(node: ast.expr) -> bool:
    """A dialect value (a name or attribute called ``*dialect*``), an API's name as a
    string, or a tuple, list or set of those."""
    if isinstance(node, ast.Name):
        return "dialect" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "dialect" in node.attr.lower()
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_the_api(item) for item in node.elts)
    return False


def protocol_switches(root: Path) -> list[str]:
    """``file:line: text`` of each comparison on an API's name outside the protocols package."""
    found: list[str] = []
    for top in SEARCHED:
        for path in sorted((root / top).rglob("*.py")):
            relative = path.relative_to(root)
            if relative.is_relative_to(PROTOCOLS_PACKAGE):
                continue
            source = path.read_text()
            lines = source.splitlines()
            numbers = sorted(
                node.lineno
                for node in ast.walk(ast.parse(source, str(path)))
                if isinstance(node, ast.Compare) and any(map(_names_the_api, [node.left, *node.comparators]))
            )
            found.extend(f"{relative}:{n}: {lines[n - 1].strip()}" for n in numbers)
    return found


def test_no_branch_on_the_api_outside_the_protocols() -> None:
    assert protocol_switches(REPO) == []


def test_a_branch_on_the_api_is_found(tmp_path: Path) -> None:
    for top in SEARCHED:
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("*.pyc", "__pycache__"))
    calls = tmp_path / "pipeline" / "gateway" / "calls.py"
    lines = calls.read_text().splitlines()
    switches = [
        'n = 1 if dialect != "responses" else 2',
        'chosen = protocol.name in ("chat", "completions")',
        'same = "messages" == kind',
        "same = route.dialect is other",
        "listed = [name for name, dialect in routes if dialect not in kinds]",
    ]
    calls.write_text("\n".join([*lines, *switches]) + "\n")
    inside = tmp_path / "pipeline" / "api" / "protocols" / "chat.py"
    inside.write_text(inside.read_text() + '\nIS_CHAT = "chat" == "chat"\n')
    numbers = range(len(lines) + 1, len(lines) + 1 + len(switches))
    assert protocol_switches(tmp_path) == [
        f"pipeline/gateway/calls.py:{number}: {switch}"
        for number, switch in zip(numbers, switches, strict=True)
    ]
