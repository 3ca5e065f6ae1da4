"""``tokentrail run``: the whole pipeline from one command, end to end, then a clean stop.

A run is three parts, each built once its inputs exist and stopped in reverse through
one ``AsyncExitStack``:

- the services (``pipeline.run.cluster``): started in this process (model, event log,
  data plane, stages, engine, worker, gateway) or, for ``tokentrail drive``
  (``RunConfig.attach``), attached to a running cluster; with them the run's outcomes
  (``pipeline.run.outcomes``): the follower of ``tokentrail.finalized`` for this run's
  rollouts and the archiver that copies each accepted sample to ``DATA_DIR/samples.jsonl``;
- the scenario (``pipeline.run.scenario``): who plays the arithmetic tool-use rollouts,
  the built-in driver against the worker or an openai-SDK agent through the gateway;
- with ``--train-steps`` the training loop (``pipeline.run.training_loop``): the rollouts
  played step by step, each followed by a GRPO step (built-in or TRL) and a refit.

A run is complete when every rollout of this run has its ``FinalizedEvent`` (accepted
or rejected), every accepted sample is archived, and both stages' consumer lag is 0.
SIGINT/SIGTERM stop it at any point: in-flight rollouts are sealed as interrupted, and
then every part stops in order (driver, worker drain, stages commit, data plane,
engine, broker) with nothing left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiokafka.errors import KafkaError

from pipeline.auth.credentials import CREDENTIALS_DIR, ROLE_FILES, Credentials, Role
from pipeline.kafka.config import ConfigError
from pipeline.kafka.embedded.broker import BrokerError
from pipeline.process.signals import STOP_SIGNALS
from pipeline.run.account import RunAccount, RunParts, summarize
from pipeline.run.cluster import RunContext, Services, attach_services, start_services
from pipeline.run.config import RunConfig, new_run_id, plan_jobs
from pipeline.run.report import RunProgress, RunSummary
from pipeline.run.scenario import Scenario, open_scenario
from pipeline.run.services import RunSetupError
from pipeline.run.shutdown import Shutdown, Stopped
from pipeline.run.training_loop import TrainingLoop, open_training
from stages.ports import SAMPLES_PARTITION, DataPlaneError

SERVING_FILE = "serving.json"
"""Written by ``--keep`` while it serves: the addresses of the broker, worker, gateway and data plane."""
log = logging.getLogger(__name__)

# Failures of the environment rather than of tokentrail: reported without a traceback.
EXPECTED_ERRORS: tuple[type[Exception], ...] = (
    RunSetupError,
    BrokerError,
    ConfigError,
    KafkaError,
    DataPlaneError,
    OSError,
)


class Run:
    """One execution of the pipeline; ``execute()`` returns its summary once all is stopped.

    Its parts exist once started (``services``, ``training``: None when the run stopped
    before them); what it finds out as it goes is its ``account``."""

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
        self.operator_token_file: str | None = None
        if config.attach is not None:  # the cluster's: its files, TOKENTRAIL_* variables over them
            credentials = Credentials.load(config.attach.credentials_dir)
        else:  # minted once per data dir, handed to the run's worker, gateway and clients
            directory = config.data_dir / CREDENTIALS_DIR
            credentials = Credentials.mint(directory)
            self.operator_token_file = str(directory / ROLE_FILES[Role.OPERATOR])
        self.context = RunContext(
            config=config,
            run_id=self.run_id,
            rollout_ids=[job.rollout_id for job in self.jobs],
            credentials=credentials,
            progress=self.progress,
            shutdown=self.shutdown,
        )
        self.services: Services | None = None
        self.training: TrainingLoop | None = None
        self.account = RunAccount()

    # -- the run ---------------------------------------------------------------

    async def execute(self) -> RunSummary:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.shutdown.on_signal, sig)
        try:
            async with contextlib.AsyncExitStack() as stack:
                with contextlib.suppress(Stopped):  # a stop between start-up steps
                    await self._run(stack)
                self.progress.enter("stopping")
                log.info("run %s: stopping", self.run_id)
        except EXPECTED_ERRORS as exc:  # a clear message is enough; no traceback
            log.error("run %s failed: %s", self.run_id, exc)
            self.account.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            log.exception("run %s failed", self.run_id)
            self.account.error = f"{type(exc).__name__}: {exc}"
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
        self.progress.enter("stopped")
        summary = self.summary()
        log.info("run %s: %s", self.run_id, summary.status)
        return summary

    async def _run(self, stack: contextlib.AsyncExitStack) -> None:
        """Start the parts, play, wait for the outcomes; with ``--keep``, serve on."""
        attach = self.config.attach
        if attach is not None:
            services = await attach_services(stack, self.context, attach)
        else:
            services = await start_services(stack, self.context)
        self.services = services
        self.shutdown.check()
        scenario = await open_scenario(stack, self.config, services, self.context.credentials)
        if self.config.train_steps:
            self.progress.enter("loading the trainer")
            self.training = await open_training(stack, self.context, services, scenario, self.jobs)
            self.shutdown.check()
        await self._until_stopped(self._work(services, scenario, self.training))
        if self.account.completed and self.config.keep:
            await self._keep_serving(services)

    async def _until_stopped(self, work: Any) -> None:
        """Run ``work`` unless a stop comes first."""
        task = asyncio.create_task(work, name="run-work")
        stopper = asyncio.create_task(self.shutdown.event.wait(), name="run-stop")
        try:
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # raises what made the work fail

    async def _work(self, services: Services, scenario: Scenario, training: TrainingLoop | None) -> None:
        """Play the rollouts (training on them, if asked), then wait for their outcomes and lag 0."""
        config, progress, outcomes = self.config, self.progress, services.outcomes
        progress.driver = scenario.player.stats
        progress.enter("driving rollouts")
        progress.driving_since = time.monotonic()
        log.info(
            "run %s: driving %d rollouts (%d groups of %d) against %s",
            self.run_id,
            len(self.jobs),
            len(self.jobs) // config.group_size,
            config.group_size,
            scenario.against,
        )
        try:
            if training is None:
                await scenario.play(self.jobs)
            else:
                await training.train()
                self.account.samples_left = len(await services.plane.list_keys(SAMPLES_PARTITION))
        finally:
            progress.driving_until = time.monotonic()

        progress.enter("waiting for finalized events")
        try:
            await asyncio.wait_for(asyncio.shield(outcomes.archiving), config.finalize_timeout_s)
        except TimeoutError:
            missing = len(outcomes.watcher.missing)
            self.account.timeout = (
                f"{missing} rollout(s) not finalized within {config.finalize_timeout_s:.0f}s"
            )
            log.error("run %s: %s", self.run_id, self.account.timeout)
            return

        progress.enter("waiting for consumer lag 0")
        self.account.lag_by_stage = await outcomes.probe.wait_for_zero(config.lag_timeout_s)
        progress.lag = dict(self.account.lag_by_stage)
        if any(self.account.lag_by_stage.values()):
            self.account.timeout = (
                f"consumer lag still {self.account.lag_by_stage} after {config.lag_timeout_s:.0f}s"
            )
            log.error("run %s: %s", self.run_id, self.account.timeout)
            return
        self.account.completed = True
        log.info("run %s: every rollout finalized, lag 0", self.run_id)

    async def _keep_serving(self, services: Services) -> None:
        """``--keep``: report, then serve the broker, data plane and worker until a signal."""
        self.progress.enter("serving (Ctrl-C to stop)")
        if self.on_complete is not None:
            self.on_complete(self.summary())
        log.info(
            "run %s: serving until Ctrl-C: bootstrap %s, data plane addresses %s, worker %s",
            self.run_id,
            services.kafka.bootstrap,
            services.dataplane_addresses,
            services.worker_url,
        )
        serving = self.config.data_dir / SERVING_FILE
        serving.write_text(json.dumps(self._serving(services), indent=2, sort_keys=True) + "\n")
        try:
            await self.shutdown.event.wait()
        finally:
            serving.unlink(missing_ok=True)

    def _serving(self, services: Services) -> dict[str, str | None]:
        """What ``--keep`` serves, for other processes to attach to (``DATA_DIR/serving.json``)."""
        return {
            "bootstrap": services.kafka.bootstrap_servers,
            "worker": services.worker_url,
            "gateway": services.gateway_url,
            "dataplane_addresses": services.dataplane_addresses,
            "operator_token_file": self.operator_token_file,
        }

    def summary(self) -> RunSummary:
        """The run's summary, as far as it got."""
        return summarize(RunParts(self.context, self.jobs, self.services, self.training), self.account)


def execute(config: RunConfig, progress: RunProgress | None = None, **options: Any) -> RunSummary:
    """Run the pipeline to the end (blocking); see ``Run`` for ``options``."""
    return asyncio.run(Run(config, progress, **options).execute())
