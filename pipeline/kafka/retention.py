"""How long each tokentrail topic keeps its records, and the least the pipeline needs
(DESIGN §7.6).

A log without retention grows without bound; a log cut too short deletes events a
consumer still has to read. The one figure every topic must outlive is how long a
rollout may stay open (the ledger's ``--max-open``): the live ledger commits the first
offset an open rollout still needs, so a restarted ledger re-reads events up to that
old, and the receipts it recalls and the outcomes downstream are younger still. A
margin on top covers the seal grace, a ledger that lags, and its restart. Anything
shorter is refused where it is asked for, before a topic is created.

Retention is by time only, and deletion only (``cleanup.policy=delete``): a byte bound
would delete by volume, whatever an open rollout still needs, so ``retention.bytes``
is set to -1 (none), overriding a cluster default; disks are sized from the rate and
the time bound instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from topics.names import TopicNames

ROLES = ("admission", "staged", "committed", "finalized", "deadletter")
"""The topics by role: each is the ``TopicNames`` property of that name."""

FOREVER = -1
"""``retention.ms`` -1: the broker never deletes by time."""

MARGIN_S = 3600.0
"""Above ``--max-open``: the seal grace, a ledger that lags or restarts, then catches up."""

_UNITS_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?$")
_DAY_MS = _UNITS_MS["d"]


@dataclass(frozen=True, slots=True)
class TopicRetention:
    """``retention.ms`` per topic role (``FOREVER``: never deleted by time).

    The defaults let a week-long run keep a few days of its log: the three topics the
    ledger reads and writes (the bulk of the log) for 3 days, enough for a stage down
    over a weekend to catch up; the token-free outcomes trainers consume for 7 days;
    dead letters, rare and read by people, for 30."""

    admission: int = 3 * _DAY_MS
    staged: int = 3 * _DAY_MS
    committed: int = 3 * _DAY_MS
    finalized: int = 7 * _DAY_MS
    deadletter: int = 30 * _DAY_MS

    def __post_init__(self) -> None:
        for role in ROLES:
            value = getattr(self, role)
            if value != FOREVER and value < 1:
                raise ValueError(f"retention: {role} must be a positive duration or forever, got {value} ms")

    def with_values(self, values: Iterable[tuple[str, int]]) -> TopicRetention:
        """These retentions with ``(role, ms)`` pairs put over them (the last one of a role wins)."""
        return dataclasses.replace(self, **dict(values))

    def topic_configs(self, names: TopicNames) -> dict[str, dict[str, str]]:
        """The retention configs of every topic, by topic name."""
        return {
            getattr(names, role): {
                "cleanup.policy": "delete",
                "retention.ms": str(getattr(self, role)),
                "retention.bytes": "-1",  # no size bound (see the module's docstring)
            }
            for role in ROLES
        }

    def shortfalls(self, max_open_s: float) -> list[str]:
        """Why each role's retention is too short for rollouts open up to ``max_open_s``
        (empty: none is); each names the flag and the figure it needs."""
        needed_ms = minimum_ms(max_open_s)
        return [
            f"--retention {role}={format_ms(getattr(self, role))} is shorter than the "
            f"{format_ms(needed_ms)} the pipeline needs: a rollout may stay open {format_ms(int(max_open_s * 1000))} "
            f"(the ledger's --max-open) and a restarted ledger re-reads its events, plus a "
            f"{format_ms(int(MARGIN_S * 1000))} margin"
            for role in ROLES
            if getattr(self, role) != FOREVER and getattr(self, role) < needed_ms
        ]

    def check(self, max_open_s: float) -> None:
        """Raise ``ValueError`` naming every role whose retention is too short."""
        problems = self.shortfalls(max_open_s)
        if problems:
            raise ValueError("; ".join(problems))


DEFAULT_RETENTION = TopicRetention()


def minimum_ms(max_open_s: float) -> int:
    """The least retention any topic may have when rollouts stay open up to ``max_open_s``."""
    return int((max_open_s + MARGIN_S) * 1000)


def parse_duration(text: str) -> int:
    """Milliseconds of ``90m``, ``36h``, ``3d``, ``2w``, ``500ms`` or plain seconds;
    ``forever`` is ``FOREVER``."""
    if text.strip().lower() == "forever":
        return FOREVER
    match = _DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration (a number with ms, s, m, h, d or w; or forever)")
    number, unit = match.groups()
    value = int(float(number) * _UNITS_MS[unit or "s"])
    if value < 1:
        raise ValueError(f"{text!r}: a retention must be longer than 0")
    return value


def format_ms(value: int) -> str:
    """``value`` milliseconds in the largest unit that writes it whole (``forever`` for -1)."""
    if value == FOREVER:
        return "forever"
    for unit in ("w", "d", "h", "m", "s"):
        if value % _UNITS_MS[unit] == 0:
            return f"{value // _UNITS_MS[unit]}{unit}"
    return f"{value}ms"


def retention_setting(text: str) -> tuple[str, int]:
    """One ``--retention ROLE=DURATION``: argparse's ``type``, so a bad one is a usage error."""
    role, sep, duration = text.partition("=")
    role = role.strip()
    if not sep or role not in ROLES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected ROLE=DURATION with ROLE one of {', '.join(ROLES)}"
        )
    try:
        return role, parse_duration(duration)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{role}: {exc}") from None


def add_retention_argument(parser: argparse.ArgumentParser) -> None:
    """``--retention ROLE=DURATION`` (repeatable), for the verbs that create topics."""
    defaults = ", ".join(f"{role}={format_ms(getattr(DEFAULT_RETENTION, role))}" for role in ROLES)
    parser.add_argument(
        "--retention",
        action="append",
        type=retention_setting,
        metavar="ROLE=DURATION",
        help=(
            "how long a topic this process creates keeps its records (retention.ms; e.g. admission=5d, "
            "finalized=2w, deadletter=forever; repeatable); never less than --max-open plus 1h. Existing "
            f"topics are not altered: a difference is logged (defaults: {defaults})"
        ),
    )


def retention_from_args(settings: Sequence[tuple[str, int]] | None) -> TopicRetention:
    """The defaults with every ``--retention`` given put over them."""
    return DEFAULT_RETENTION.with_values(settings or ())


def retention_arguments(retention: TopicRetention) -> list[str]:
    """``--retention`` flags giving ``retention`` back to a child (the roles off their default)."""
    return [
        flag
        for role in ROLES
        if getattr(retention, role) != getattr(DEFAULT_RETENTION, role)
        for flag in ("--retention", f"{role}={format_ms(getattr(retention, role))}")
    ]


def differences(asked: Mapping[str, str], found: Mapping[str, str]) -> list[str]:
    """``key: found X, asked Y`` for each asked config an existing topic does not have as asked
    (a missing key is the broker's default, shown as ``unset``)."""
    return [
        f"{key}: found {_readable(key, found.get(key))}, asked {_readable(key, value)}"
        for key, value in asked.items()
        if found.get(key) != value
    ]


def _readable(key: str, value: str | None) -> str:
    if value is None:
        return "unset"
    if key == "retention.ms" and value.lstrip("-").isdigit():
        return format_ms(int(value))
    return value
