"""A library's dependencies: ranges a trainer's own pins can live with, exact versions for CI.

tokentrail is installed next to a trainer that pins its own numpy, pydantic or torch, so its
runtime dependencies are compatible ranges; `make install` and CI apply
deploy/constraints.txt, which pins each of them to the version the suite runs.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def runtime_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"]]
    return {requirement.name: requirement for requirement in requirements}


def constraints() -> dict[str, Version]:
    pinned: dict[str, Version] = {}
    for line in (ROOT / "deploy" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pinned[name.strip()] = Version(version.strip())
    return pinned


def test_runtime_dependencies_are_ranges_and_ci_pins_each_inside_its_range() -> None:
    requirements, pinned = runtime_requirements(), constraints()
    assert set(pinned) == set(requirements)
    for name, requirement in requirements.items():
        assert not any(spec.operator == "==" for spec in requirement.specifier), requirement
        assert requirement.specifier.contains(pinned[name]), (requirement, pinned[name])


def test_an_older_numpy_or_pydantic_minor_is_admitted() -> None:
    requirements = runtime_requirements()
    assert requirements["numpy"].specifier.contains(Version("2.2.6"))
    assert requirements["pydantic"].specifier.contains(Version("2.11.9"))
