"""``tokentrail run``: the whole pipeline from one command, end to end, then a clean stop.

Order of start (each part stops in reverse, through one ``AsyncExitStack``):

1. the model (the tiny model is built in the data directory if missing);
2. the event log: the embedded tansu broker (durable in the data directory) or an
   external Kafka, and the topics; what an earlier run on this data directory and log
   left open when it was killed is sealed as ``interrupted`` (``pipeline.run.journal``);
3. the vLLM engine, which blocks the event loop while it starts and so comes before
   any Kafka or data-plane client exists;
4. the data plane (embedded TransferQueue, addresses in ``DATA_DIR/dataplane.json``,
   or TransferQueue on Ray), the event producer, the lag probe;
5. the ledger and finalizer stages (consumer groups that resume from their committed
   offsets, so a second run on the same data directory continues the log): by default
   ``tokentrail stage`` child processes, attached to the broker and to the data plane's
   address file, and waited for until their groups assigned them partitions
   (``--stages processes``); or tasks in this process (``--stages inline``);
6. the follower of ``tokentrail.finalized`` for this run's rollouts and the archiver
   that copies each accepted sample to ``DATA_DIR/samples.jsonl``;
7. the capture worker on a free loopback port, and the rollout driver playing the
   arithmetic tool-use environment against it over HTTP; with ``--agent sdk`` a gateway
   in front of the worker, and an agent that only uses the openai SDK through it.

``tokentrail drive`` (``RunConfig.attach``) skips 1, 3, 5 and 7: it uses the cluster's
broker, data plane, stages and worker or gateway, and only follows and archives. With
``--train-steps`` the rollouts are played step by step, each followed by a GRPO step
and a refit of the worker (``pipeline.run.training``).

A run is complete when every rollout of this run has its ``FinalizedEvent`` (accepted
or rejected), every accepted sample is archived, and both stages' consumer lag is 0.
SIGINT/SIGTERM stop it at any point: in-flight rollouts are sealed as interrupted, and
then every part stops in order (driver, worker drain, stages commit, data plane,
engine, broker) with nothing left running.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from pipeline.auth.credentials import CREDENTIALS_DIR, ROLE_FILES, Credentials, Role
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import ConfigError, KafkaConfig
from pipeline.kafka.embedded.broker import BrokerError
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.reader import topic_ends
from pipeline.run.archiver import SampleArchiver
from pipeline.run.chat_http import HttpChatEndpoint
from pipeline.run.config import Attach, RunConfig, new_run_id, plan_jobs
from pipeline.run.driver import Player, SealTrackingClient, play_jobs
from pipeline.run.finalized_watch import FinalizedWatcher
from pipeline.run.journal import RunJournal, close_dead_runs
from pipeline.run.report import RunProgress, RunStatus, RunSummary, outcome_totals
from pipeline.run.sdk_agent import SdkAgent
from pipeline.run.services import (
    RunSetupError,
    data_plane_flags,
    ensure_model,
    event_log,
    event_log_identity,
    run_groups,
    running_stages,
    serving_gateway,
    serving_worker,
    stage_children,
    start_engine,
)
from pipeline.run.training import WEIGHTS_DIR, ClosedLoop, advance, refit
from pipeline.samples.archive import SampleArchive, archive_path, read_archive
from pipeline.samples.drift import Drift, drift_of, model_tokenizer
from pipeline.stagehost.lag import StageLagProbe
from pipeline.trainer.feed import FeedSettings, TrainerFeed
from pipeline.trainer.grpo import GrpoTrainer
from pipeline.trainer.steplog import StepWriter
from pipeline.trainer.trl import TrlBridge, prompt_key
from pipeline.trainer.trl import train as train_with_trl
from pipeline.worker.tokenizer_mode import resolve_tokenizer_mode
from stages.client import RolloutClient
from stages.driver import Job, RolloutDriver
from stages.ledger.stage import LedgerConfig
from stages.ports import SAMPLES_PARTITION, DataPlane, DataPlaneError
from stages.trainer.batch import TrainBatch
from stages.trainer.staleness import StalenessPolicy

SERVING_FILE = "serving.json"
"""Written by ``--keep`` while it serves: the addresses of the broker, worker, gateway and data plane."""
TRL_DIR = "trl"
"""Under the data directory: TRL's output directory (its logs; weights go to ``weights/``)."""
log = logging.getLogger(__name__)

LAG_POLL_S = 1.0
# Failures of the environment rather than of tokentrail: reported without a traceback.
EXPECTED_ERRORS: tuple[type[Exception], ...] = (
    RunSetupError,
    BrokerError,
    ConfigError,
    KafkaError,
    DataPlaneError,
    OSError,
)


class _Stopped(Exception):
    """Internal: a stop was requested between start-up steps."""


class Shutdown:
    """Why the run stops early: a signal, or a part that failed. Set from handlers."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.signal: int | None = None
        self.failure: str | None = None

    def on_signal(self, signum: int) -> None:
        if self.event.is_set():
            log.warning("%s received again; already stopping", signal.Signals(signum).name)
            return
        self.signal = signum
        log.warning("%s received: stopping the run", signal.Signals(signum).name)
        self.event.set()

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("stopping the run: %s", reason)
        self.event.set()

    def check(self) -> None:
        if self.event.is_set():
            raise _Stopped()


class Run:
    """One execution of the pipeline; ``execute()`` returns its summary once all is stopped."""

    def __init__(
        self,
        config: RunConfig,
        progress: RunProgress | None = None,
        *,
        on_complete: Callable[[RunSummary], None] | None = None,
    ) -> None:
        self.config = config
        self.run_id = config.run_id or new_run_id()
        self.jobs = plan_jobs(
            self.run_id,
            rollouts=config.total_rollouts,
            group_size=config.group_size,
            seed=config.seed,
            tasks=config.tasks,
            reward=config.reward,
        )
        self.progress = progress if progress is not None else RunProgress()
        self.progress.run_id = self.run_id
        self.progress.rollouts = len(self.jobs)
        self.on_complete = on_complete
        self.shutdown = Shutdown()
        self.model_dir: Path = config.resolved_model_dir
        self.kafka: KafkaConfig | None = None
        self.worker_url: str | None = None
        self.dataplane_addresses: str | None = None
        self.watcher: FinalizedWatcher | None = None
        self.archiver: SampleArchiver | None = None
        self.gateway_url: str | None = None
        self._seals: SealTrackingClient | None = None
        self._agent: SdkAgent | None = None
        self.lag_by_stage: dict[str, int] = {}
        self._sink: KafkaEventSink | None = None
        self._endpoint: HttpChatEndpoint | None = None
        self._probe: StageLagProbe | None = None
        self._archiving: asyncio.Task[None] | None = None
        self._plane: DataPlane | None = None
        self.journal: RunJournal | None = None
        self.training: ClosedLoop | None = None
        self.trl: TrlBridge | None = None
        self._feed: TrainerFeed | None = None
        self._archived_expected = 0
        self.samples_left: int | None = None
        self.closed_interrupted = 0
        self.timeout: str | None = None
        self.error: str | None = None
        self.completed = False
        self.operator_token_file: str | None = None
        if config.attach is not None:  # the cluster's: its files, TOKENTRAIL_* variables over them
            self.credentials = Credentials.load(config.attach.credentials_dir)
        else:  # minted once per data dir, handed to the run's worker, gateway and clients
            directory = config.data_dir / CREDENTIALS_DIR
            self.credentials = Credentials.mint(directory)
            self.operator_token_file = str(directory / ROLE_FILES[Role.OPERATOR])

    # -- the run ---------------------------------------------------------------

    async def execute(self) -> RunSummary:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self.shutdown.on_signal, sig)
        try:
            async with contextlib.AsyncExitStack() as stack:
                try:
                    await self._start(stack)
                    await self._drive()
                    if self.completed and self.config.keep:
                        await self._keep_serving()
                except _Stopped:
                    pass
                self.progress.enter("stopping")
                log.info("run %s: stopping", self.run_id)
        except EXPECTED_ERRORS as exc:  # a clear message is enough; no traceback
            log.error("run %s failed: %s", self.run_id, exc)
            self.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            log.exception("run %s failed", self.run_id)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
        self.progress.enter("stopped")
        summary = self.summary()
        log.info("run %s: %s", self.run_id, summary.status)
        return summary

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        if self.config.attach is not None:
            await self._attach(stack, self.config.attach)
        else:
            await self._start_all(stack)
        self.shutdown.check()

    async def _start_all(self, stack: contextlib.AsyncExitStack) -> None:
        """Every part in this process: broker, data plane, stage processes, engine, stages, worker."""
        config, progress, shutdown = self.config, self.progress, self.shutdown
        progress.enter("preparing the model")
        self.model_dir = await asyncio.to_thread(ensure_model, config)
        shutdown.check()

        progress.enter("starting the event log")
        kafka, broker = await stack.enter_async_context(event_log(config, shutdown.fail))
        self.kafka = kafka
        await ensure_topics(kafka)
        shutdown.check()

        progress.enter("starting the data plane")
        from pipeline.dataplane import DataPlaneConfig, open_data_plane

        plane_config = DataPlaneConfig(
            mode=config.dataplane_mode, data_dir=config.data_dir, ray_address=config.ray_address
        )
        plane = await stack.enter_async_context(open_data_plane(plane_config))
        if config.dataplane_mode == "embedded":
            self.dataplane_addresses = str(plane_config.addresses_path)
        shutdown.check()

        ledger = LedgerConfig(seal_grace_s=config.seal_grace_s, max_open_s=config.max_open_s)
        tuning = run_groups(broker, config.fetch_wait_ms)
        children = None
        if config.stages == "processes":
            # Started before the engine, whose start blocks this loop for tens of seconds:
            # the children boot and join their groups meanwhile, in processes of their own.
            progress.enter("starting the stage processes")
            flags = data_plane_flags(config, plane_config.addresses_path)
            children = await stack.enter_async_context(
                stage_children(
                    kafka, flags, ledger, on_failure=shutdown.fail, stop=shutdown.event, tuning=tuning
                )
            )

        progress.enter("starting the vLLM engine")
        log.info("starting the vLLM engine on %s", self.model_dir)
        tokenizer_mode = resolve_tokenizer_mode(self.model_dir, config.tokenizer_mode)
        engine = start_engine(self.model_dir, config.seed, tokenizer_mode)
        stack.callback(engine.shutdown)
        shutdown.check()

        # Followers and in-process stages are consumer-group members on this loop: they
        # start once the engine no longer blocks it, so their sessions never lapse.
        sink = await self._follow(stack, kafka, plane, event_log_identity(kafka, broker))
        progress.enter("starting the stages")
        if children is None:
            await stack.enter_async_context(
                running_stages(kafka, sink, plane, ledger, on_failure=shutdown.fail, tuning=tuning)
            )
        else:
            await children.ready()
        shutdown.check()  # a child that exited, or a signal, while they were getting ready

        progress.enter("starting the worker")
        credentials = self.credentials
        server = await stack.enter_async_context(
            serving_worker(
                self.model_dir, engine, plane, sink, credentials, self.config.reasoning_parser, tokenizer_mode
            )
        )
        self.worker_url = server.url
        self._endpoint = await stack.enter_async_context(
            HttpChatEndpoint(server.url, headers=credentials.authorization(Role.SERVICE))
        )
        if config.train_steps:
            progress.enter("loading the trainer")
            self._feed = await self._trainer_feed(stack, kafka, plane)
            if config.trainer == "builtin":
                self.training = await self._closed_loop(self._feed, server.url)
        if config.agent == "sdk":
            progress.enter("starting the gateway")
            assert self._seals is not None
            gateway_url = await stack.enter_async_context(
                serving_gateway(server.url, sink, self._seals, credentials)
            )
            await self._sdk_agent(stack, gateway_url, self.model_dir.name)

    async def _attach(self, stack: contextlib.AsyncExitStack, attach: Attach) -> None:
        """``tokentrail drive``: the cluster's broker, data plane, stages and workers are running."""
        from pipeline.dataplane import attach_data_plane

        self.progress.enter("attaching")
        self.kafka = kafka = self.config.kafka
        await ensure_topics(kafka)
        if attach.dataplane_addresses is not None:
            self.dataplane_addresses = str(attach.dataplane_addresses)
        plane = await stack.enter_async_context(attach_data_plane(attach.dataplane_addresses))
        await self._follow(stack, kafka, plane, event_log_identity(kafka, None))
        if attach.worker_url is not None:
            self.worker_url = attach.worker_url
            self._endpoint = await stack.enter_async_context(
                HttpChatEndpoint(attach.worker_url, headers=self.credentials.authorization(Role.SERVICE))
            )
        if attach.gateway_url is not None:
            assert attach.model is not None  # Attach checked it
            await self._sdk_agent(stack, attach.gateway_url, attach.model)

    async def _follow(
        self, stack: contextlib.AsyncExitStack, kafka: KafkaConfig, plane: DataPlane, log_identity: str
    ) -> KafkaEventSink:
        """The producer, the lag probe, the journal, and the follower and archiver of this
        run's finalized events; returns the producer."""
        config, progress = self.config, self.progress
        self._plane = plane
        self._sink = sink = await stack.enter_async_context(KafkaEventSink(kafka))
        self._probe = probe = await stack.enter_async_context(StageLagProbe(kafka))
        self.closed_interrupted = await close_dead_runs(config.data_dir, log_identity, RolloutClient(sink))
        self.journal = journal = RunJournal(config.data_dir, self.run_id, log_identity)
        stack.callback(journal.close)
        self._seals = SealTrackingClient(sink, journal)
        archive = stack.enter_context(SampleArchive(archive_path(config.data_dir)))
        self.watcher = watcher = FinalizedWatcher(
            kafka, [job.rollout_id for job in self.jobs], on_event=progress.record
        )
        self.archiver = archiver = SampleArchiver(
            plane, archive, self.run_id, on_written=lambda n: setattr(progress, "samples_written", n)
        )
        start = await topic_ends(kafka, kafka.names.finalized)
        self._task(stack, watcher.follow(start), "finalized-follower")
        self._archiving = self._task(stack, archiver.run(watcher.stream), "sample-archiver")
        self._task(stack, self._poll_lag(probe), "lag-poller")
        return sink

    async def _sdk_agent(self, stack: contextlib.AsyncExitStack, gateway_url: str, model: str) -> None:
        config = self.config
        self.gateway_url = gateway_url
        self._agent = agent = SdkAgent(
            gateway_url,
            model,
            sampling=config.sampling,
            max_tokens=config.max_tokens,
            max_turns=config.turns,
            seed=config.seed,
            headers=self.credentials.authorization(Role.ENVIRONMENT),
        )
        stack.push_async_callback(agent.aclose)

    async def _trainer_feed(
        self, stack: contextlib.AsyncExitStack, kafka: KafkaConfig, plane: DataPlane
    ) -> TrainerFeed:
        """The trainer feed: this run's rollouts only, one step's groups a batch."""
        config = self.config
        wanted = {job.rollout_id for job in self.jobs}
        settings = FeedSettings(
            group_size=config.group_size,
            groups_per_batch=config.rollouts // config.group_size,
            group_timeout_s=config.finalize_timeout_s,
            staleness=StalenessPolicy(max_staleness=config.max_staleness, measure=config.staleness_measure),
            shift_behaviour_temperature=config.shift_behaviour_temperature,
        )
        feed = TrainerFeed(kafka, plane, settings, only=lambda event: event.rollout_id in wanted)
        await stack.enter_async_context(feed)
        return feed

    async def _closed_loop(self, feed: TrainerFeed, worker_url: str) -> ClosedLoop:
        """The built-in trainer: its own copy of the weights, one GRPO step a batch."""
        config = self.config
        trainer = await asyncio.to_thread(
            GrpoTrainer, self.model_dir, learning_rate=config.learning_rate, dtype=config.trainer_dtype
        )
        return ClosedLoop(
            feed,
            trainer,
            worker_url,
            config.data_dir,
            batch_timeout_s=config.finalize_timeout_s,
            operator_headers=self.credentials.authorization(Role.OPERATOR),
            trainer_delay_s=config.trainer_delay_s,
            step_writer=StepWriter(config.data_dir, self.run_id, "builtin"),
        )

    def _task(
        self, stack: contextlib.AsyncExitStack, coro: Coroutine[Any, Any, None], name: str
    ) -> asyncio.Task[None]:
        """A background task that is cancelled (and awaited) when the stack unwinds to it."""
        task = asyncio.create_task(coro, name=name)

        def failed(done: asyncio.Task[None]) -> None:
            if not done.cancelled() and done.exception() is not None:
                self.shutdown.fail(f"{name}: {done.exception()!r}")

        task.add_done_callback(failed)

        async def cancel() -> None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

        stack.push_async_callback(cancel)
        return task

    async def _drive(self) -> None:
        """Drive the rollouts and wait for their outcomes, unless a stop comes first."""
        work = asyncio.create_task(self._work(), name="run-work")
        stopper = asyncio.create_task(self.shutdown.event.wait(), name="run-stop")
        try:
            await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not work.done():
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work  # raises what made the work fail

    async def _work(self) -> None:
        config, progress = self.config, self.progress
        assert self._sink is not None
        assert self._archiving is not None and self._probe is not None
        assert self._seals is not None
        client = self._seals
        player: Player
        if self._agent is not None:
            player = self._agent
        else:
            assert self._endpoint is not None
            player = RolloutDriver(
                client,
                self._endpoint,
                sampling=config.sampling,
                max_tokens=config.max_tokens,
                max_turns=config.turns,
                seed=config.seed,
            )
        progress.driver = player.stats
        progress.enter("driving rollouts")
        progress.driving_since = time.monotonic()
        log.info(
            "run %s: driving %d rollouts (%d groups of %d) against %s",
            self.run_id,
            len(self.jobs),
            len(self.jobs) // config.group_size,
            config.group_size,
            self.worker_url,
        )
        try:
            if not config.train_steps:
                await play_jobs(player, client, self.jobs, config.concurrency)
            elif config.trainer == "trl":
                await self._train_trl(player, client)
            else:
                await self._train(player, client)
        finally:
            progress.driving_until = time.monotonic()

        progress.enter("waiting for finalized events")
        try:
            await asyncio.wait_for(asyncio.shield(self._archiving), config.finalize_timeout_s)
        except TimeoutError:
            assert self.watcher is not None
            self.timeout = f"{len(self.watcher.missing)} rollout(s) not finalized within {config.finalize_timeout_s:.0f}s"
            log.error("run %s: %s", self.run_id, self.timeout)
            return

        progress.enter("waiting for consumer lag 0")
        self.lag_by_stage = await self._probe.wait_for_zero(config.lag_timeout_s)
        progress.lag = dict(self.lag_by_stage)
        if any(self.lag_by_stage.values()):
            self.timeout = f"consumer lag still {self.lag_by_stage} after {config.lag_timeout_s:.0f}s"
            log.error("run %s: %s", self.run_id, self.timeout)
            return
        self.completed = True
        log.info("run %s: every rollout finalized, lag 0", self.run_id)

    async def _archived(self, batch: TrainBatch) -> None:
        """Returns once the run's archive holds the batch's samples: none trains unarchived."""
        assert self.archiver is not None
        archiver, timeout_s = self.archiver, self.config.finalize_timeout_s
        self._archived_expected += sum(len(m.event.sample_keys) for g in batch.groups for m in g.members)
        deadline = time.monotonic() + timeout_s
        while archiver.written + len(archiver.failed) < self._archived_expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"samples not archived within {timeout_s:.0f}s")
            await asyncio.sleep(0.05)

    async def _train(self, player: Player, client: SealTrackingClient) -> None:
        """``--train-steps``: each step's rollouts, then its GRPO step and refit; with
        ``--max-staleness``, every step's rollouts all along, paced, beside the steps."""
        assert self.training is not None and self._plane is not None
        config = self.config
        slots = [self.jobs[i : i + config.rollouts] for i in range(0, len(self.jobs), config.rollouts)]
        if config.max_staleness is None:
            for step, jobs in enumerate(slots, start=1):
                self.progress.enter(f"train step {step}/{config.train_steps}")
                play = functools.partial(play_jobs, player, client, jobs, config.concurrency)
                await self.training.run_step(step, play, self._archived)
        else:
            self.progress.enter(f"training {config.train_steps} steps, paced")

            async def play_paced(pace: Callable[[int], Awaitable[None]]) -> None:
                await play_jobs(player, client, self.jobs, config.concurrency, pace=pace)

            await self.training.run_paced(
                [{job.group_id for job in jobs} for jobs in slots],
                play_paced,
                self._archived,
                max_staleness=config.max_staleness,
                rollouts_per_step=config.rollouts,
            )
        self.samples_left = len(await self._plane.list_keys(SAMPLES_PARTITION))

    async def _train_trl(self, player: Player, client: SealTrackingClient) -> None:
        """``--trainer trl``: TRL's GRPOTrainer asks for each step's groups by prompt; each is
        played, verified and archived, and TRL's weights refit the worker after every step."""
        assert self._feed is not None and self._plane is not None and self.worker_url is not None
        config, feed, worker_url = self.config, self._feed, self.worker_url
        size = config.group_size
        planned = [self.jobs[i : i + size] for i in range(0, len(self.jobs), size)]
        unplayed: dict[str, collections.deque[list[Job]]] = collections.defaultdict(collections.deque)
        for group in planned:
            unplayed[prompt_key(group[0].task.prompt())].append(group)
        operator = self.credentials.authorization(Role.OPERATOR)

        async def play(prompts: list[list[dict[str, Any]]]) -> list[str]:
            groups = [unplayed[prompt_key(prompt)].popleft() for prompt in prompts]
            self.progress.enter(
                f"train step {len(self.trl.steps) + 1 if self.trl else 1}/{config.train_steps}"
            )
            await play_jobs(player, client, [job for group in groups for job in group], config.concurrency)
            return [group[0].group_id for group in groups]

        async def next_batch(group_ids: list[str]) -> TrainBatch:
            try:
                batch = await asyncio.wait_for(feed.next_batch(group_ids), config.finalize_timeout_s)
            except TimeoutError:
                raise TimeoutError(
                    f"rollouts not finalized within {config.finalize_timeout_s:.0f}s"
                ) from None
            await self._archived(batch)
            return batch

        async def refit_to(path: Path, version: int) -> None:
            await refit(worker_url, path, version=version, headers=operator)
            await advance(feed, None, version)

        self.trl = TrlBridge(
            asyncio.get_running_loop(),
            play=play,
            next_batch=next_batch,
            refit=refit_to,
            ack=feed.ack,
            version=lambda: feed.policy_version,
            weights_dir=config.data_dir / WEIGHTS_DIR,
            step_writer=StepWriter(config.data_dir, self.run_id, "trl"),
        )
        await asyncio.to_thread(
            train_with_trl,
            self.trl,
            self.model_dir,
            [group[0].task.prompt() for group in planned],
            group_size=size,
            groups_per_step=config.rollouts // size,
            steps=config.train_steps,
            learning_rate=config.learning_rate,
            output_dir=config.data_dir / TRL_DIR,
            seed=config.seed,
            dtype=config.trainer_dtype,
        )
        self.samples_left = len(await self._plane.list_keys(SAMPLES_PARTITION))

    async def _keep_serving(self) -> None:
        """``--keep``: report, then serve the broker, data plane and worker until a signal."""
        self.progress.enter("serving (Ctrl-C to stop)")
        if self.on_complete is not None:
            self.on_complete(self.summary())
        log.info(
            "run %s: serving until Ctrl-C: bootstrap %s, data plane addresses %s, worker %s",
            self.run_id,
            self.kafka.bootstrap if self.kafka else None,
            self.dataplane_addresses,
            self.worker_url,
        )
        serving = self.config.data_dir / SERVING_FILE
        serving.write_text(json.dumps(self._serving(), indent=2, sort_keys=True) + "\n")
        try:
            await self.shutdown.event.wait()
        finally:
            serving.unlink(missing_ok=True)

    def _serving(self) -> dict[str, str | None]:
        """What ``--keep`` serves, for other processes to attach to (``DATA_DIR/serving.json``)."""
        return {
            "bootstrap": self.kafka.bootstrap_servers if self.kafka else None,
            "worker": self.worker_url,
            "gateway": self.gateway_url,
            "dataplane_addresses": self.dataplane_addresses,
            "operator_token_file": self.operator_token_file,
        }

    async def _poll_lag(self, probe: StageLagProbe) -> None:
        """Keep the progress view's lag current (errors only leave it stale)."""
        while True:
            try:
                self.progress.lag = await probe.read()
            except Exception as exc:
                log.debug("lag reading failed: %s", exc)
            await asyncio.sleep(LAG_POLL_S)

    # -- the account -----------------------------------------------------------

    def _train_steps(self) -> list[dict[str, Any]] | None:
        steps = self.training.steps if self.training is not None else self.trl.steps if self.trl else None
        return None if steps is None else [step.as_json() for step in steps]

    def _paced_waits(self) -> int | None:
        """Rollouts held back by the paced loop or a paced gateway; None when nothing paced."""
        paced = self.progress.driver.paced
        gate = self.training.gate if self.training is not None else None
        if gate is not None:
            paced += gate.waits
        elif not paced:
            return None
        return paced

    def status(self) -> RunStatus:
        if self.completed and self.error is None and self.shutdown.failure is None:
            return "completed"  # a signal while --keep served a finished run is the normal stop
        if self.shutdown.signal is not None:
            return "interrupted"
        if self.error is not None or self.shutdown.failure is not None:
            return "failed"
        if self.timeout is not None:
            return "timeout"
        return "failed"

    def summary(self) -> RunSummary:
        config, progress = self.config, self.progress
        events = list(self.watcher.events.values()) if self.watcher is not None else []
        tokens, generated = outcome_totals(events)
        accepted = sum(1 for event in events if event.status == "accepted")
        rejected = self.watcher.rejected if self.watcher is not None else {}
        stats = progress.driver
        drive_s = None
        if progress.driving_since is not None:
            drive_s = (progress.driving_until or time.monotonic()) - progress.driving_since
        written = self.archiver.written if self.archiver is not None else 0
        status = self.status()
        if status == "completed" and written != sum(len(event.sample_keys) for event in events):
            status = "failed"
        errors = [e for e in (self.error, self.shutdown.failure, self.timeout) if e]
        if self.archiver is not None and self.archiver.failed:
            errors.append(f"{len(self.archiver.failed)} sample(s) could not be archived")
        lag = self.lag_by_stage or progress.lag
        return RunSummary(
            status=status,
            run_id=self.run_id,
            rollouts=len(self.jobs),
            group_size=config.group_size,
            turns=config.turns,
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            sampling=config.sampling,
            seed=config.seed,
            finalized=len(events),
            accepted=accepted,
            rejected=dict(rejected),
            missing=self.watcher.missing if self.watcher is not None else [j.rollout_id for j in self.jobs],
            calls=stats.calls,
            capture_failed=stats.capture_failed,
            broken=stats.broken,
            tokens_captured=tokens,
            generated_tokens=generated,
            samples_written=written,
            samples_file=str(archive_path(config.data_dir)),
            data_dir=str(config.data_dir),
            model_dir=str(self.model_dir) if config.attach is None else (config.attach.model or ""),
            bootstrap=self.kafka.bootstrap_servers
            if self.kafka is not None
            else config.kafka.bootstrap_servers,
            dataplane_mode=config.dataplane_mode,
            dataplane_addresses=self.dataplane_addresses,
            worker_url=self.worker_url,
            agent=config.agent,
            gateway_url=self.gateway_url,
            lag=sum(lag.values()) if lag else None,
            lag_by_stage=dict(lag),
            elapsed_s=time.monotonic() - progress.started,
            drive_s=drive_s,
            signal=self.shutdown.signal,
            error="; ".join(errors) or None,
            closed_interrupted=self.closed_interrupted,
            train_steps=self._train_steps(),
            dataplane_samples_left=self.samples_left,
            paced_waits=self._paced_waits(),
            stages=config.stages if config.attach is None else None,
            retokenization=self._retokenization(),
        )

    def _retokenization(self) -> Drift | None:
        """The drift over this run's archived samples, read with the served model's tokenizer."""
        tokenizer = model_tokenizer(self.model_dir)
        if tokenizer is None:
            return None
        archived = read_archive(archive_path(self.config.data_dir), run_id=self.run_id).records
        return drift_of(archived, tokenizer)


def execute(config: RunConfig, progress: RunProgress | None = None, **options: Any) -> RunSummary:
    """Run the pipeline to the end (blocking); see ``Run`` for ``options``."""
    return asyncio.run(Run(config, progress, **options).execute())
