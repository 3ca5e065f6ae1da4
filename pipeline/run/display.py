"""What a person watching ``tokentrail run`` sees: a live progress view and a summary table.

The live view is drawn only when stderr is a terminal (and not with ``--json``):
rollouts admitted, sealed and finalized, calls per second, consumer lag per stage.
Meanwhile the log lines go to a file (``pipeline.run.terminal``). The summary table is
the human counterpart of the ``--json`` document.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from pipeline.run.report import RunProgress, RunSummary


class ProgressView:
    """Renders a ``RunProgress`` afresh on every refresh of the live display."""

    def __init__(self, progress: RunProgress) -> None:
        self.progress = progress
        self._spinner = Spinner("dots")

    def __rich__(self) -> RenderableType:
        p = self.progress
        now = time.monotonic()
        head = Table.grid(padding=(0, 1))
        head.add_row(
            self._spinner,
            Text(f"tokentrail run {p.run_id}", style="bold"),
            Text(f"{p.phase}", style="cyan"),
            Text(f"{now - p.started:6.1f}s", style="dim"),
        )
        body = Table.grid(padding=(0, 2))
        body.add_column(style="bold")
        body.add_column()
        total = p.rollouts
        stats = p.driver
        body.add_row(
            "rollouts",
            f"admitted {stats.admitted}/{total}   sealed {stats.sealed}/{total}   "
            f"finalized {p.finalized}/{total}",
        )
        rejected = ", ".join(f"{reason} {count}" for reason, count in sorted(p.rejected.items()))
        body.add_row(
            "outcomes",
            f"accepted {p.accepted}   rejected {sum(p.rejected.values())}"
            + (f" ({rejected})" if rejected else ""),
        )
        body.add_row(
            "calls",
            f"{stats.calls}   {p.calls_per_s(now):.1f}/s   capture failed {stats.capture_failed}",
        )
        body.add_row("samples", f"archived {p.samples_written}")
        lag = "   ".join(f"{stage} {value}" for stage, value in p.lag.items()) or "-"
        body.add_row("lag", lag)
        return Group(head, body)


@contextlib.contextmanager
def live_progress(progress: RunProgress, console: Console) -> Iterator[None]:
    """Show the live view on ``console`` while the block runs (``pipeline.run.terminal``
    keeps everything else off that terminal; what the console prints goes above the view).
    ``sys.stdout`` and ``sys.stderr`` stay what they are: the log file, for every library
    that looks them up while the view is up."""
    with Live(
        ProgressView(progress),
        console=console,
        refresh_per_second=4,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    ):
        yield


def summary_table(summary: RunSummary) -> Table:
    """The end-of-run table: outcomes, rejections by reason, tokens, samples, lag."""
    table = Table(title=f"tokentrail run {summary.run_id}: {summary.status}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row(
        "rollouts",
        f"{summary.rollouts} ({summary.rollouts // summary.group_size} groups "
        f"of {summary.group_size}, up to {summary.turns} turns)",
    )
    table.add_row("accepted", str(summary.accepted))
    rejected = sum(summary.rejected.values())
    table.add_row("rejected", str(rejected))
    for reason, count in sorted(summary.rejected.items()):
        table.add_row(f"  {reason}", str(count))
    if summary.missing:
        table.add_row("not finalized", str(len(summary.missing)))
    rate = f" ({summary.calls_per_s:.1f}/s)" if summary.calls_per_s is not None else ""
    table.add_row("calls", f"{summary.calls}{rate}")
    table.add_row("tokens captured", f"{summary.tokens_captured} ({summary.generated_tokens} generated)")
    table.add_row("samples written", f"{summary.samples_written} -> {summary.samples_file}")
    if summary.retokenization is not None and summary.retokenization.turns:
        drift = summary.retokenization
        table.add_row(
            "re-tokenization", f"{drift.drifted} of {drift.turns} generated turns would change (ids kept)"
        )
    lag = ", ".join(f"{stage} {value}" for stage, value in summary.lag_by_stage.items())
    table.add_row("consumer lag", f"{summary.lag} ({lag})" if lag else "unknown")
    table.add_row("temperature", str(summary.temperature))
    table.add_row("model", summary.model_dir)
    table.add_row("data dir", summary.data_dir)
    table.add_row("elapsed", f"{summary.elapsed_s:.1f}s")
    if summary.error:
        table.add_row("error", Text(summary.error, style="red"))
    return table


def keep_banner(summary: RunSummary) -> str:
    """What ``--keep`` prints while it serves: where to point the other verbs."""
    lines = ["serving until Ctrl-C:"]
    if summary.bootstrap:
        lines.append(f"  bootstrap            {summary.bootstrap}")
    if summary.dataplane_addresses:
        lines.append(f"  data-plane addresses {summary.dataplane_addresses}")
    if summary.worker_url:
        lines.append(f"  worker               {summary.worker_url}/v1/chat/completions")
    if summary.bootstrap:
        lines.append(f"  try: tokentrail lag --bootstrap {summary.bootstrap}")
        lines.append(f"       tokentrail replay --bootstrap {summary.bootstrap} --out ledger.sqlite --check")
    return "\n".join(lines)
