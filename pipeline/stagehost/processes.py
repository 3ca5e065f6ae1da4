"""Stages as child processes: ``tokentrail stage NAME`` started by this process.

A stage in a process of its own has an interpreter (a core) of its own instead of
sharing one event loop with everything else. The parent starts each child with
``--ready-fd`` and, when it chooses (``StartedStages.ready``: after starting an engine,
say), waits for that line (the child's group assigned it partitions), so "ready" means
serving, not "started a while ago". A child that exits on its own is
reported to ``on_failure``; on exit each child gets SIGTERM (it finishes its batch,
commits and leaves its group) and, after ``stop_timeout_s``, SIGKILL.

The children run in sessions of their own, so a terminal's Ctrl-C reaches the parent
only and the parent stops them in its own order. Whoever starts them calls
``pipeline.process.guard.guard_descendants`` first: a SIGKILL of the parent then takes
them along (they carry its marker and are among its noted descendants).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from pipeline.kafka.config import KafkaConfig, kafka_arguments
from pipeline.kafka.consumer import ConsumerTuning
from pipeline.process.flags import to_argv
from pipeline.process.jsonlog import configured_format
from pipeline.stagehost.settings import StageBounds, StageHostSettings
from stages.finalize.janitor import JanitorConfig
from stages.ledger.stage import LedgerConfig
from stages.specs import STAGES, StageSettings, staging_ttl

log = logging.getLogger(__name__)

CLI_MODULE = "pipeline.cli"
"""The module behind the ``tokentrail`` console script: a child runs ``python -m`` it."""


@dataclass(frozen=True, slots=True)
class StageOptions:
    """What a stage child is told besides its Kafka config: the settings an in-process
    stage gets (``pipeline.run.services.running_stages``)."""

    ledger: LedgerConfig
    tuning: ConsumerTuning
    data_plane: Mapping[str, Any] = field(default_factory=dict)
    """How a stage that reads rows reaches the data plane: ``StageHostSettings`` fields
    (``dataplane_mode``, ``dataplane_addresses``, ...)."""
    group: str | None = None
    """None: the stage's own group."""
    bounds: StageBounds = field(default_factory=StageBounds)
    """What the stage keeps of finished rollouts (the run's ``--remember`` and the rest)."""

    @property
    def in_process(self) -> StageSettings:
        """What a stage on the run's own loop is built with: what a child is told, less the
        data plane, which it is handed."""
        return StageSettings(
            ledger=self.ledger,
            remember=self.bounds.remember,
            closed_budget_bytes=self.bounds.closed_budget_bytes,
            janitor=JanitorConfig(ttl_s=staging_ttl(self.ledger)),
        )


def stage_settings(name: str, options: StageOptions) -> StageHostSettings:
    """The settings of stage ``name``'s process: ``options``, as the in-process stage has them."""
    ledger, tuning = options.ledger, options.tuning
    return StageHostSettings.model_validate(
        {
            "name": name,
            "group": options.group,
            "seal_grace_s": ledger.seal_grace_s,
            "max_open_s": ledger.max_open_s,
            "staging_ttl_s": staging_ttl(ledger),
            "session_timeout_ms": tuning.session_timeout_ms,
            "heartbeat_ms": tuning.heartbeat_interval_ms,
            "fetch_wait_ms": tuning.fetch_wait_ms,
            "merge_margin_ms": tuning.idle_margin_ms,
            **options.bounds.model_dump(),
            **(options.data_plane if STAGES[name].uses_data_plane else {}),
        }
    )


def stage_command(name: str, kafka: KafkaConfig, options: StageOptions) -> list[str]:
    """The command line of ``tokentrail stage NAME`` with ``options``, in this interpreter."""
    return [
        sys.executable, "-m", CLI_MODULE, "stage",
        *to_argv(stage_settings(name, options)),
        *kafka_arguments(kafka),
        "--log-format", configured_format(),
    ]  # fmt: skip


class StageProcess:
    """One ``tokentrail stage`` child: started, waited for until ready, stopped."""

    def __init__(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str], stderr: IO[str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.stderr = stderr
        self.process: asyncio.subprocess.Process | None = None
        self._ready_fd: int | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    async def start(self) -> None:
        read, write = os.pipe()
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                "--ready-fd",
                str(write),
                pass_fds=(write,),
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=self.stderr,
                start_new_session=True,  # stopped by this process, in its order, not by a terminal
            )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        self._ready_fd = read
        log.info("stage %s started as process %d", self.name, self.process.pid)

    async def ready(self) -> bool:
        """Until the child says it is ready (True) or exits first (False)."""
        assert self.process is not None and self._ready_fd is not None, "not started"
        line = asyncio.create_task(_read_line(self._ready_fd))
        exited = asyncio.create_task(self.process.wait())
        try:
            await asyncio.wait({line, exited}, return_when=asyncio.FIRST_COMPLETED)
            return line.done() and line.exception() is None and bool(line.result())
        finally:
            for task in (line, exited):
                task.cancel()
            os.close(self._ready_fd)
            self._ready_fd = None

    async def exited(self) -> int:
        assert self.process is not None, "not started"
        return await self.process.wait()

    async def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code (None: never started)."""
        process = self.process
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                log.warning("stage %s did not stop in %.0fs; killing it", self.name, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        return await process.wait()


async def _read_line(fd: int) -> bytes:
    """What the child writes to its readiness pipe (b"" once it closed it unwritten)."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[bytes] = loop.create_future()

    def readable() -> None:
        if not received.done():
            try:
                received.set_result(os.read(fd, 64))
            except OSError as exc:
                received.set_exception(exc)

    loop.add_reader(fd, readable)
    try:
        return await received
    finally:
        loop.remove_reader(fd)


@dataclass(slots=True)
class StartedStages:
    """Stage children that were started; ``ready`` waits until they serve."""

    children: dict[str, StageProcess]
    stop: asyncio.Event
    report: Callable[[StageProcess, int], None]

    async def ready(self) -> None:
        """Until every child is ready, one exits first (reported to ``on_failure``), or
        ``stop`` is set."""
        for child in await _all_ready(list(self.children.values()), self.stop):
            self.report(child, await child.exited())


@contextlib.asynccontextmanager
async def stage_processes(
    commands: Mapping[str, Sequence[str]],
    *,
    on_failure: Callable[[str], None],
    stop: asyncio.Event,
    stop_timeout_s: float,
    env: Mapping[str, str] | None = None,
    stderr: IO[str] | None = None,
) -> AsyncIterator[StartedStages]:
    """Start a child per command without waiting for it: the caller may do other work
    (start an engine) while they boot, then ``await started.ready()``. A child that exits
    on its own, before or after it was ready, calls ``on_failure`` (once); on exit every
    child is stopped."""
    environment = {**os.environ, **(env or {})}
    children = {
        name: StageProcess(name, argv, env=environment, stderr=stderr) for name, argv in commands.items()
    }
    stopping = False
    reported: set[str] = set()

    def report(child: StageProcess, code: int) -> None:
        if not stopping and child.name not in reported:
            reported.add(child.name)
            on_failure(f"stage {child.name} stopped (process {child.pid}, exit code {code})")

    def watch(child: StageProcess) -> Callable[[asyncio.Task[int]], None]:
        def done(task: asyncio.Task[int]) -> None:
            if not task.cancelled():
                report(child, task.result())

        return done

    watchers: list[asyncio.Task[int]] = []
    try:
        for child in children.values():
            await child.start()
            watcher = asyncio.create_task(child.exited(), name=f"stage-{child.name}-exit")
            watcher.add_done_callback(watch(child))
            watchers.append(watcher)
        yield StartedStages(children, stop, report)
    finally:
        stopping = True
        codes = await asyncio.gather(*(child.stop(stop_timeout_s) for child in children.values()))
        for watcher in watchers:
            watcher.cancel()
        log.info("stage processes stopped: %s", dict(zip(children, codes, strict=True)))


async def _all_ready(children: list[StageProcess], stop: asyncio.Event) -> list[StageProcess]:
    """Until every child is ready, one exits first, or ``stop`` is set; returns those
    that exited before they were ready."""
    waiting = {asyncio.create_task(child.ready()): child for child in children}
    stopped = asyncio.create_task(stop.wait())
    try:
        while waiting and not stop.is_set():
            done, _ = await asyncio.wait({*waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            exited = [waiting[task] for task in done if task in waiting and not task.result()]
            if exited:
                return exited
            for task in done - {stopped}:
                del waiting[task]
        if not waiting:
            log.info("stage processes ready: %s", ", ".join(child.name for child in children))
        return []
    finally:
        stopped.cancel()
        for task in waiting:
            task.cancel()
