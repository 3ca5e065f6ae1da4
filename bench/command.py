"""The command line of a benchmark, declared once: ``tokentrail bench NAME`` and ``python -m bench.NAME``.

Every benchmark has the same shape on the command line: ``--quick`` (a smaller config),
``--json`` (the full report), a few options of its own that override fields of its
config, a ``run(config) -> dict`` and a ``render(report) -> str``. A module declares what
is its own in a ``Benchmark``; the flags, the config, the command line in the report, the
report on stdout and ``python -m`` are done here, so that both entry points stay the same.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Config = TypeVar("Config", bound="DataclassInstance")


@dataclass(frozen=True, slots=True)
class Option:
    """One option of a benchmark's own: when given, its value (read with ``type``) replaces
    ``field`` of the config (by default the option's name), or with ``for_run`` goes to
    ``run`` as a keyword argument (an output path, say: not part of the measured config).
    A ``switch`` takes no value: given, it sets its field to True (``--tail``)."""

    flag: str
    help: str
    type: Callable[[str], Any] = str
    choices: Sequence[str] | None = None
    field: str = ""
    for_run: bool = False
    switch: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under: ``--max-batch`` → ``max_batch``."""
        return self.flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True, slots=True)
class Quick(Generic[Config]):
    """What ``--quick`` runs instead of the default config, and its help: a smaller sweep."""

    help: str
    config: Config


@dataclass(frozen=True, slots=True)
class Benchmark(Generic[Config]):
    """What one benchmark declares; the CLI verb and ``python -m bench.NAME`` both read it."""

    name: str
    """``tokentrail bench NAME``; the module's name with ``-`` for ``_``."""
    doc: str | None
    default: Config
    quick: Quick[Config]
    options: tuple[Option, ...]
    run: Callable[..., dict[str, Any]]
    """``run(config, **for_run options) -> report``; programs call it too, without a command line."""
    render: Callable[[dict[str, Any]], str]
    failures: Callable[[dict[str, Any]], list[str]] | None = None
    """What in a finished report contradicts the benchmark's own ground truth, a line each:
    printed on stderr after the report, with exit status 1, so that a script can gate on it."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """``--quick``, ``--json`` and the benchmark's own options, in that order."""
        parser.add_argument("--quick", action="store_true", help=self.quick.help)
        parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        for option in self.options:
            if option.switch:  # absent: None, so the config's own value stays
                parser.add_argument(option.flag, action="store_const", const=True, help=option.help)
            else:
                parser.add_argument(option.flag, type=option.type, choices=option.choices, help=option.help)

    def config(self, args: argparse.Namespace) -> Config:
        """The quick or default config with the options given on the command line."""
        changes = {
            option.field or option.dest: value
            for option in self.options
            if not option.for_run and (value := getattr(args, option.dest)) is not None
        }
        return replace(self.quick.config if args.quick else self.default, **changes)

    def run_args(self, args: argparse.Namespace, command: str) -> int:
        """Run with the parsed options; the report, with ``command`` in it (a number is comparable
        only with what produced it), on stdout, as JSON with ``--json``; then any ``failures``."""
        keywords = {option.dest: getattr(args, option.dest) for option in self.options if option.for_run}
        report = self.run(self.config(args), **keywords)
        report["command"] = command
        print(json.dumps(report, sort_keys=True) if args.json else self.render(report))
        failures = self.failures(report) if self.failures is not None else []
        for line in failures:
            print(line, file=sys.stderr)
        return 1 if failures else 0

    def main(self, argv: Sequence[str] | None = None) -> int:
        """``python -m bench.NAME``: the same options and report as ``tokentrail bench NAME``."""
        parser = argparse.ArgumentParser(
            prog=f"python -m bench.{self.name.replace('-', '_')}",
            description=self.doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.add_arguments(parser)
        argv = list(sys.argv[1:] if argv is None else argv)
        return self.run_args(parser.parse_args(argv), shlex.join(["tokentrail", "bench", self.name, *argv]))


def ints(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` → ``(1, 4, 16)``, for sweep options."""
    return tuple(int(part) for part in _parts(text))


def floats(text: str) -> tuple[float, ...]:
    """``"0,1.5"`` → ``(0.0, 1.5)``, for sweep options."""
    return tuple(float(part) for part in _parts(text))


def names(text: str) -> tuple[str, ...]:
    """``"staged, enqueued"`` → ``("staged", "enqueued")``, for options that pick by name."""
    return tuple(_parts(text))


def _parts(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


__all__ = ["Benchmark", "Option", "Quick", "floats", "ints", "names"]
