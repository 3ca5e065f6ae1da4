"""Consumer lag as the operator reads it: a table on a terminal, or one JSON document.

The rows come from ``pipeline.kafka.lag``; this module only says them. A commit below
the log start is shown as its own lost range: records deleted before the group read them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader, LostRange, PartitionLag, lag_by_group, total_lag


async def read_lag(
    config: KafkaConfig, groups: list[str] | None, topics: list[str] | None
) -> list[PartitionLag]:
    """Every partition's lag of ``groups`` on ``topics`` (None: all of them)."""
    async with LagReader(config) as reader:
        return await reader.lag(groups=groups, topics=topics)


def lost_ranges(rows: list[PartitionLag]) -> list[LostRange]:
    return [lost for row in rows if (lost := row.lost) is not None]


def report(bootstrap: str, rows: list[PartitionLag]) -> dict[str, Any]:
    """The ``--json`` document."""
    return {
        "bootstrap": bootstrap,
        "broker": "up",
        "total_lag": total_lag(rows),
        "groups": lag_by_group(rows),
        "partitions": [row.as_dict() for row in rows],
        "lost": [{**asdict(lost), "records": lost.records} for lost in lost_ranges(rows)],
    }


def down_report(bootstrap: str, error: BaseException) -> dict[str, Any]:
    """The ``--json`` document when the broker cannot be reached: lag unknown, not zero."""
    return {"bootstrap": bootstrap, "broker": "down", "error": str(error)}


def table(rows: list[PartitionLag]) -> Table:
    """Names are never cut: their columns are as wide as the longest (see ``print_table``)."""
    out = Table(title="consumer lag", caption=f"total lag: {total_lag(rows)}")
    for name in ("group", "topic", "partition", "committed", "highwater", "lag", "lost"):
        named = name in ("group", "topic")
        out.add_column(
            name,
            justify="left" if named else "right",
            no_wrap=True,
            overflow="ignore" if named else "ellipsis",
        )
    for row in rows:
        committed = "-" if row.committed is None else str(row.committed)
        lost = "" if (gone := row.lost) is None else f"{gone.first}-{gone.end - 1}"
        out.add_row(
            row.group, row.topic, str(row.partition), committed, str(row.highwater), str(row.lag), lost
        )
    return out


def print_table(rendered: Table) -> None:
    """On a terminal at its width, else (a pipe, a log) as wide as the table needs."""
    console = Console()
    needed = console.measure(rendered, options=console.options.update(max_width=10_000)).maximum
    if not console.is_terminal or console.width < needed:
        console = Console(width=needed)
    console.print(rendered)
