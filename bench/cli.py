"""``tokentrail bench NAME``: the benchmarks from the CLI, one per entry of ``BENCHMARKS``.

The runtime does not import the benchmarks: this verb is registered as an entry point
(``tokentrail.verbs`` in ``pyproject.toml``), which ``pipeline.cli`` loads after its own
verbs. Each benchmark (``bench.engine``, ``bench.pipeline``, ``bench.replay``,
``bench.long_horizon``, ...) has a ``run(...) -> dict`` for programs and a ``BENCHMARK``
(``bench.command``) that declares its options, the same here as for ``python -m``;
their heavy imports (torch, TransferQueue, the broker) happen when a benchmark runs, not
when the CLI starts. A benchmark's name is its module's, with ``-`` for ``_``.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Callable
from typing import Any

from bench.command import Benchmark

BENCHMARKS: dict[str, str] = {
    "engine": "engine throughput with capture off, inline and tokentrail, vs data-plane delay",
    "pipeline": "calls/s, rollouts/s and seal-to-finalized latency through ledger + finalizer",
    "tq-controller": "TransferQueue's controller: CPU per put, get and delete of one row, ops/s per controller core",
    "replay": "events/s rebuilding the ledger from the log",
    "checkpoint": "a rebuild's restart at 10^4..10^6 events of history: checkpoint + tail vs offset 0",
    "rebalance": "stage processes under load: a kill -9 and a rolling restart, outcomes and the pause",
    "gateway-recovery": "a restarted gateway's recovery at 10^4..10^6 events of history: bookmark vs the beginning",
    "long-horizon": "event bytes and ledger memory per call as one rollout grows to 10,000 calls",
    "main-job": "the main job end to end, memory vs durable broker storage, wall time side by side",
    "vllm": "the real vLLM worker's tokens/s with capture off vs on, per ack policy",
    "quotas": "well-behaved agents' latency through the gateway alone vs beside a flooding agent",
    "inspect": "the inspector in chromium: first render of a 100,000-rollout table and a 32K-token view",
    "splice": "the worker's splice CPU per call beside vLLM's own render, at 10, 100 and 1,000 turns",
    "soak": "stage memory slope per 10,000 rollouts, consumer lag and disk per call over a long steady run",
    "gateway-soak": "the real gateway's and worker's memory slope per 10,000 rollouts of SDK agents over a long run",
    "log-trip": "a record's trip into the log under soak load, beside the ledger's log-time merge margin",
    "learning": "mean reward per training step with each trainer on the dense digits reward: does the loop learn",
    "digest": "hashing MB/s of token bytes and staging rows built per second, list vs numpy input",
    "capture-hook": "the capture core's completion hook per call at 1K..32K tokens, hashing apart",
    "megatron-hooks": "the Megatron capture hooks per call (prepare, stage, read, hashing) at 1K..32K tokens",
    "kafka-events": "produce and consume rates of typical events on an embedded broker, the codec alone beside",
    "broker-storage": "small record batches read back from tansu, memory vs durable storage; --tail: a live consumer",
    "dataplane": "TransferQueue put and get of staged rows, one and a batch at a time, embedded and separate",
    "amplification": "rollouts rejected per lost call: fail-closed vs terminal-chain rejection, on the real stages",
}

EXAMPLES = """\
examples:
  tokentrail bench engine --quick
  tokentrail bench engine --json --plot bench/engine_throughput.png
  tokentrail bench pipeline --instances 1,2 --lengths 16 --json
  tokentrail bench tq-controller --quick --json
  tokentrail bench replay --sizes 10000,100000
  tokentrail bench checkpoint --quick --json
  tokentrail bench rebalance --quick --json
  tokentrail bench gateway-recovery --quick --json
  tokentrail bench long-horizon --quick --json
  tokentrail bench main-job --quick --json
  tokentrail bench vllm --quick --json
  tokentrail bench quotas --quick --json
  tokentrail bench inspect --quick --json
  tokentrail bench splice --quick --json
  tokentrail bench soak --minutes 30
  tokentrail bench gateway-soak --minutes 15 --json
  tokentrail bench log-trip --minutes 5 --storage durable --json
  tokentrail bench learning --json --plot bench/learning_curve.png
  tokentrail bench digest --json
  tokentrail bench capture-hook --quick
  tokentrail bench megatron-hooks --json
  tokentrail bench kafka-events --events 40000 --json
  tokentrail bench broker-storage --tail --batches 3000 --json
  tokentrail bench dataplane --placements separate --tokens 64,1024 --rows 512
  tokentrail bench amplification --calls 16,64 --fail 0.006,0.01 --rollouts 2000 --json
"""


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` and its benchmarks on the CLI's subparsers."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help=f"run a benchmark ({', '.join(BENCHMARKS)})",
        description="Run one of the benchmarks (DESIGN §9); --json prints the full report.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, summary in BENCHMARKS.items():
        benchmark: Benchmark[Any] = importlib.import_module(f"bench.{name.replace('-', '_')}").BENCHMARK
        sub: argparse.ArgumentParser = which.add_parser(
            name,
            help=summary,
            description=benchmark.doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        benchmark.add_arguments(sub)
        sub.set_defaults(run=_runner(benchmark))


def _runner(benchmark: Benchmark[Any]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return benchmark.run_args(args, shlex.join(["tokentrail", *sys.argv[1:]]))

    return run
