"""The layout rules of docs/DESIGN.md §2, checked on the source tree itself.

A newcomer finds the architecture in the folders; these tests keep it there: the
contract is a leaf, the stages never import the runtime, only the Kafka package builds
Kafka clients, the runtime root holds only the CLI, and every design reference in the
code names a section the design has.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("topics", "stages", "pipeline")


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _modules(package)
        for name in sorted(_imports(path))
        if name.split(".")[0] in forbidden
    ]


def test_the_contract_imports_nothing_of_the_project() -> None:
    assert (
        _offenders("topics", ("stages", "pipeline", "bench", "aiokafka", "torch", "vllm", "megatron")) == []
    )


def test_the_stages_never_import_the_runtime() -> None:
    assert _offenders("stages", ("pipeline", "bench", "aiokafka")) == []


def test_the_runtime_never_imports_the_benchmarks() -> None:
    assert _offenders("pipeline", ("bench",)) == []


def _kafka_clients(path: Path) -> set[str]:
    """aiokafka's client classes a file imports (its errors and types are fine anywhere)."""
    return {
        alias.name
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aiokafka")
        for alias in node.names
        if alias.name in {"AIOKafkaConsumer", "AIOKafkaProducer", "AIOKafkaAdminClient"}
    }


def test_only_the_kafka_package_builds_kafka_clients() -> None:
    outside = {
        str(path.relative_to(ROOT)): sorted(clients)
        for package in (*PRODUCT, "bench")
        for path in _modules(package)
        if not path.is_relative_to(ROOT / "pipeline" / "kafka") and (clients := _kafka_clients(path))
    }
    assert outside == {}


def test_the_runtime_root_holds_only_the_cli() -> None:
    assert sorted(p.name for p in (ROOT / "pipeline").glob("*.py")) == ["__init__.py", "cli.py"]


def test_the_runtime_never_names_a_concrete_stage() -> None:
    concrete = re.compile(r"\b(LedgerStage|FinalizerStage)\b")
    named = [
        str(path.relative_to(ROOT)) for path in _modules("pipeline") if concrete.search(path.read_text())
    ]
    assert named == []


@pytest.mark.parametrize("package", [*PRODUCT, "bench", "tests"])
def test_every_design_reference_names_a_section_the_design_has(package: str) -> None:
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    sections = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", design, re.M))
    assert {"3", "4.2", "4.3", "5", "6", "7", "9", "10"} <= sections
    cited = {
        (str(path.relative_to(ROOT)), number)
        for path in (ROOT / package).rglob("*.py")
        for number in re.findall(r"DESIGN(?:\.md)? §(\d+(?:\.\d+)?)", path.read_text())
    }
    assert [(path, number) for path, number in sorted(cited) if number not in sections] == []
