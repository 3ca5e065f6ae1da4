"""Each benchmark's smallest configuration runs and reports the right shape.

Only shapes and positivity are checked, never timings: the numbers belong in
bench/RESULTS.md, measured side by side, not in assertions on a shared machine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import json
import os
import threading
import time
from collections.abc import Iterator
from inspect import signature
from pathlib import Path
from typing import Any

import pytest

from bench import inspect as inspect_bench
from bench import ledger_memory, main_job, quotas, vllm
from bench.cli import BENCHMARKS
from bench.command import Benchmark, Option, Quick, ints
from bench.common import thread_cpu_s
from bench.engine import MODES, EngineConfig
from bench.long_horizon import LongHorizonConfig
from bench.pipeline import PipelineConfig
from bench.replay import ReplayConfig
from pipeline import cli

PNG = b"\x89PNG\r\n\x1a\n"


def quick_config(name: str, *options: str) -> Any:
    """The config ``tokentrail bench NAME --quick OPTIONS`` runs."""
    benchmark = importlib.import_module(f"bench.{name.replace('-', '_')}").BENCHMARK
    return benchmark.config(cli.build_parser().parse_args(["bench", name, "--quick", *options]))


@pytest.fixture(scope="module")
def engine_report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from bench import engine

    config = EngineConfig(
        concurrency=4,
        max_batch=2,
        turns=2,
        first_prompt=8,
        user_tokens=4,
        warmup_s=0.2,
        measure_s=0.5,
        trials=1,
        latencies_ms=(0.0, 2.0),
        finishing=(2,),
        placement="memory",
    )
    yield engine.run(config, model_dir=tmp_path_factory.mktemp("bench") / "model")


def test_engine_report_has_every_mode_per_cell(engine_report: dict[str, Any]) -> None:
    assert engine_report["benchmark"] == "engine"
    cells = engine_report["cells"]
    assert [(c["latency_ms"], c["finishing"]) for c in cells] == [(0.0, 2), (2.0, 2)]
    for cell in cells:
        assert set(cell["modes"]) == set(MODES)
        for mode in MODES:
            numbers = cell["modes"][mode]
            assert numbers["tokens_per_s"] > 0
            assert numbers["step_ms"]["p99"] >= numbers["step_ms"]["p50"] > 0
            assert numbers["capture_failed"] == 0
        assert cell["tokentrail_over_off"] > 0 and cell["inline_over_off"] > 0
    assert len(engine_report["trials"]) == 2 * len(MODES)
    assert engine_report["machine"]["cpus"] >= 1 and "numpy" in engine_report["versions"]


def test_engine_plot_is_a_png(engine_report: dict[str, Any], tmp_path: Path) -> None:
    from bench.plots import engine_throughput

    path = engine_throughput(engine_report, tmp_path / "engine.png")
    assert path.read_bytes().startswith(PNG)


def test_ledger_memory_reports_positive_bytes_per_open_rollout() -> None:
    result = ledger_memory.run(rollouts=20, lengths=(2,))
    assert [r["calls_per_rollout"] for r in result] == [2]
    for r in result:
        assert r["bytes_per_open_rollout"] > 0 and r["bytes_per_open_call"] > 0
        assert len(r["bytes_left_after_wave"]) == 2


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.dataplane
def test_pipeline_smallest_configuration_inline_and_as_processes(tmp_path: Path) -> None:
    from bench import pipeline

    config = PipelineConfig(
        instances=(1,),
        lengths=(2,),
        calls=32,
        latency_calls=8,
        min_latency_rollouts=6,
        memory_rollouts=20,
        quiet_s=0.5,
        modes=("inline", "processes"),
    )
    report = pipeline.run(config, plot=tmp_path / "cdf.png")
    inline, processes = report["results"]
    assert (inline["mode"], processes["mode"]) == ("inline", "processes")
    for result in (inline, processes):
        assert result["instances"] == 1 and result["calls_per_rollout"] == 2
        assert result["backlog"]["calls"] == 32 and result["backlog"]["calls_per_s"] > 0
        latency = result["latency"]
        assert latency["rollouts"] == 6 and latency["p99_ms"] >= latency["p50_ms"] > 0
        assert len(latency["cdf_ms"]) == 101
        # Split at each receipt's log time: the ledger decides, then the finalizer's hop.
        deciding, finalizing = latency["seal_to_receipt_ms"], latency["receipt_to_finalized_ms"]
        assert 0 < deciding["p50"] <= latency["max_ms"] and 0 < finalizing["p50"] <= latency["max_ms"]
        assert result["finalized"] == {"accepted": 16 + 6}  # real digests, verified by the finalizer
        assert result["cpu_s"]["bench"] > 0
    assert inline["duplicates"] == {"ledger": 0, "finalizer": 0} and inline["revocations"] is not None
    table = pipeline.render(report).splitlines()
    assert table[0].count("|") == table[1].count("|") == table[2].count("|")  # every column filled
    # Each stage its own process, its CPU counted apart (in clock ticks: a tiny backlog may read 0).
    assert set(processes["cpu_s"]) == {"bench", "broker", "ledger-0", "finalizer-0"}
    assert all(seconds >= 0 for seconds in processes["cpu_s"].values())
    assert report["ledger_memory"][0]["bytes_per_open_rollout"] > 0
    best = max(inline["backlog"]["calls_per_s"], processes["backlog"]["calls_per_s"])
    assert report["summary"]["calls_per_s_best"] == best
    assert report["summary"]["finalize_p99_ms"] == max(
        inline["latency"]["p99_ms"], processes["latency"]["p99_ms"]
    )
    by_mode = report["summary"]["by_mode"]
    assert by_mode["processes"]["calls_per_s_best"] == processes["backlog"]["calls_per_s"]
    cpu = sum(processes["cpu_s"].values()) * 1000 / processes["backlog"]["calls"]
    assert by_mode["processes"]["pipeline_cpu_ms_per_call"] == round(cpu, 3)
    assert report["summary"]["pipeline_cpu_ms_per_call"] == min(
        m["pipeline_cpu_ms_per_call"] for m in by_mode.values()
    )
    assert Path(report["plot"]).read_bytes().startswith(PNG)


def test_pipeline_processes_need_transferqueue() -> None:
    with pytest.raises(ValueError, match="memory data plane"):
        PipelineConfig(placement="memory", modes=("processes",))
    with pytest.raises(ValueError, match="modes"):
        PipelineConfig(modes=("threads",))


@pytest.mark.slow
@pytest.mark.broker
def test_replay_smallest_configuration() -> None:
    from bench import replay

    report = replay.run(ReplayConfig(sizes=(340,), sample=340, processes=(1, 2), rounds=1))
    one, two = report["results"]
    assert (one["processes"], two["processes"]) == (1, 2)
    for result in (one, two):
        assert result["events"] == 340 and result["events_per_s"] > 0 and result["events_per_cpu_s"] > 0
        assert result["stored"] == {"call_committed": 160, "receipt": 20}
    summary = report["summary"]
    assert summary["events_per_s"] == max(one["events_per_s"], two["events_per_s"])
    assert summary["speedup_by_processes"]["2"] == round(two["events_per_s"] / one["events_per_s"], 2)
    assert report["without_broker"]["decode_events_per_s"] > 0
    assert report["without_broker"]["ledger_events_per_s"] > 0


@pytest.mark.broker
def test_broker_storage_tail_reads_a_short_partition_whole() -> None:
    """The live-consumer mode: on both engines a reader at the start of a short partition
    of single-record batches reads every one, and durable storage reports its store's CPU."""
    from bench import broker_storage

    config = quick_config("broker-storage", "--tail", "--batches", "40")
    assert config == broker_storage.BrokerStorageConfig(batches=40, tail=True)
    report = broker_storage.run(config)
    assert report["tail"] is True and set(report["results"]) == {"memory", "durable"}
    for numbers in report["results"].values():
        assert numbers["read"] == numbers["of"] == 40 and numbers["read_per_s"] > 0
    assert report["results"]["durable"]["store_cpu_ms_per_batch"] > 0


@pytest.mark.slow
@pytest.mark.broker
def test_gateway_recovery_smallest_configuration() -> None:
    from bench import gateway_recovery

    report = gateway_recovery.run(gateway_recovery.GatewayRecoveryConfig(sizes=(340,), open=3, calls=2))
    (result,) = report["results"]
    assert result["reopened"] == 3 and result["tail_events"] == 3 * 4 and result["history_events"] == 340
    assert result["restart_from_bookmark_s"] > 0 and result["restart_from_beginning_s"] > 0
    assert "| 340 |" in gateway_recovery.render(report)


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.dataplane
def test_long_horizon_smallest_configuration() -> None:
    from bench import long_horizon

    report = long_horizon.run(LongHorizonConfig(lengths=(2,)))
    assert report["benchmark"] == "long-horizon"
    (result,) = report["results"]
    assert result["calls"] == result["captured_calls"] == 2 and not result["errors"]
    for figure in ("admission", "staged", "committed"):
        assert report[f"{figure}_bytes_per_call"]["2"] == result["bytes_per_call"][figure] > 0
    assert report["ledger_bytes_per_open_call"]["2"] > 0
    assert result["committed_events"] == {"call_committed": 2, "receipt": 1}
    assert set(result["largest_event_bytes"]) == {"admission", "staged", "call_committed", "receipt"}
    assert min(result["largest_event_bytes"].values()) > 0 and result["replay_differences"] == 0
    assert result["finalized"]["status"] == "accepted"  # real digests, verified by the finalizer
    assert (report["accepted"], report["rejected"], report["rejection_reasons"]) == (1, 0, {})
    assert report["replay_equal"] is True and report["errors"] == {}
    assert report["machine"]["cpus"] >= 1


def test_main_job_summary_compares_the_median_runs_of_the_largest_size() -> None:
    def trial(storage: str, rollouts: int, wall_s: float, drive_s: float) -> dict[str, Any]:
        return {"storage": storage, "rollouts": rollouts, "wall_s": wall_s, "drive_s": drive_s,
                "accepted": rollouts, "lag": 0}  # fmt: skip

    trials = [
        trial("memory", 64, 50.0, 10.0),
        trial("durable", 64, 60.0, 15.0),
        trial("memory", 256, 80.0, 40.0),
        trial("durable", 256, 100.0, 50.0),
        trial("memory", 256, 90.0, 44.0),
        trial("durable", 256, 96.0, 48.0),
    ]
    summary = main_job.summarize(trials, (64, 256))
    assert summary["largest"] == 256
    assert summary["durable_over_memory"] == round(98.0 / 85.0, 3)
    assert summary["durable_over_memory_drive"] == round(49.0 / 42.0, 3)
    assert summary["sizes"]["64"]["durable_over_memory"] == 1.2
    assert summary["all_accepted"] and summary["lag_zero"]
    trials[1] = trial("durable", 64, 60.0, 15.0) | {"accepted": 63}
    assert not main_job.summarize(trials, (64, 256))["all_accepted"]


def test_main_job_names_the_processes_of_the_job() -> None:
    python = "/venv/bin/python3"
    assert (
        main_job.process_role([python, "-m", "pipeline.kafka.embedded.objectstore", "/d/s3"], "python3")
        == "store"
    )
    assert main_job.process_role(["/x/bin/tansu", "broker", "--cluster-id", "c"], "tansu") == "broker"
    assert main_job.process_role([], "VLLM::EngineCore") == "engine"
    assert main_job.process_role([python, "-m", "pipeline.process.reaper", "1"], "python3") == "reaper"


def test_cli_wires_the_benchmarks() -> None:
    parser = cli.build_parser()
    engine = parser.parse_args(["bench", "engine", "--quick", "--latencies", "0,5", "--json"])
    assert engine.benchmark == "engine" and engine.quick and engine.json and callable(engine.run)
    from bench import engine as engine_bench
    from bench import pipeline as pipeline_bench
    from bench import replay as replay_bench

    assert engine_bench.BENCHMARK.config(engine).latencies_ms == (0.0, 5.0)
    piped = parser.parse_args(["bench", "pipeline", "--instances", "1,2", "--lengths", "4"])
    assert pipeline_bench.BENCHMARK.config(piped).instances == (1, 2)
    assert pipeline_bench.BENCHMARK.config(piped).modes == ("inline",)
    both = parser.parse_args(["bench", "pipeline", "--quick", "--modes", "inline,processes"])
    assert pipeline_bench.BENCHMARK.config(both).modes == ("inline", "processes")
    replayed = parser.parse_args(["bench", "replay", "--sizes", "1000"])
    assert replay_bench.BENCHMARK.config(replayed).sizes == (1000,)
    long = parser.parse_args(["bench", "long-horizon", "--quick", "--lengths", "3,30", "--timeout", "5"])
    from bench import long_horizon

    config = long_horizon.BENCHMARK.config(long)
    assert (config.lengths, config.timeout_s) == ((3, 30), 5.0) and callable(long.run)
    job = parser.parse_args(["bench", "main-job", "--quick", "--trials", "2", "--json"])
    assert main_job.BENCHMARK.config(job) == main_job.MainJobConfig(sizes=(64,), trials=2)
    flooded = parser.parse_args(["bench", "quotas", "--quick", "--in-flight", "2,8", "--flood", "16"])
    assert quotas.BENCHMARK.config(flooded) == quotas.QuotaBenchConfig(
        calls=4, trials=1, flood=16, in_flight=(2, 8)
    )
    inspected = parser.parse_args(["bench", "inspect", "--quick", "--rollouts", "500", "--long-tokens", "64"])
    assert inspect_bench.BENCHMARK.config(inspected) == inspect_bench.InspectBenchConfig(
        rollouts=500, long_tokens=64, trials=2, hovers=2, page=100
    )


def test_a_benchmark_prints_its_report_with_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Options given replace fields of the quick (or default) config, and the report on stdout
    carries the command line that produced it, as ``tokentrail bench NAME`` spells it."""

    @dataclasses.dataclass(frozen=True)
    class Toy:
        sizes: tuple[int, ...] = (1, 2)
        rounds: int = 3

    def run(config: Toy) -> dict[str, Any]:
        return {"config": dataclasses.asdict(config)}

    toy = Benchmark(
        "toy-bench", "A toy.", Toy(), Quick("small", Toy(rounds=1)), (Option("--sizes", "", ints),), run, str
    )
    assert toy.main(["--quick", "--json", "--sizes", "4,5"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "command": "tokentrail bench toy-bench --quick --json --sizes 4,5",
        "config": {"sizes": [4, 5], "rounds": 1},
    }


def test_a_switch_sets_its_field_and_failures_set_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    """A switch left out keeps the config's value; a report with failures still prints, then
    its failures go to stderr with exit status 1."""

    @dataclasses.dataclass(frozen=True)
    class Toy:
        tail: bool = False

    def run(config: Toy) -> dict[str, Any]:
        return {"tail": config.tail}

    toy = Benchmark(
        "toy-bench",
        "A toy.",
        Toy(),
        Quick("tail", Toy(tail=True)),
        (Option("--tail", "", switch=True),),
        run,
        str,
        failures=lambda report: ["read the tail"] if report["tail"] else [],
    )
    assert toy.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tail"] is False
    assert toy.main(["--json", "--tail"]) == 1
    printed = capsys.readouterr()
    assert json.loads(printed.out)["tail"] is True and printed.err == "read the tail\n"
    assert toy.main(["--quick"]) == 1 and "'tail': True" in capsys.readouterr().out


TOOLS = {"loadgen", "sample_owner", "plots", "named_threads"}
"""bench modules that run as programs but measure nothing: processes and charts the benchmarks use."""


def test_every_runnable_bench_module_is_a_listed_benchmark() -> None:
    """A module that runs as ``python -m bench.NAME`` is on the harness under its own name and
    listed for ``tokentrail bench``, unless it is one of the tools."""
    folder = Path(__file__).parents[2] / "bench"
    runnable = {path.stem for path in folder.glob("*.py") if '__name__ == "__main__"' in path.read_text()}
    assert runnable - TOOLS == {name.replace("-", "_") for name in BENCHMARKS}
    for name in BENCHMARKS:
        assert importlib.import_module(f"bench.{name.replace('-', '_')}").BENCHMARK.name == name


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_option_lands_somewhere(name: str) -> None:
    """Each option names a field of its benchmark's config or a keyword of its ``run``: a
    misspelt one would otherwise fail only when that option is given."""
    benchmark = importlib.import_module(f"bench.{name.replace('-', '_')}").BENCHMARK
    fields = {field.name for field in dataclasses.fields(benchmark.default)}
    keywords = set(signature(benchmark.run).parameters)
    assert {option.field or option.dest for option in benchmark.options if not option.for_run} <= fields
    assert {option.dest for option in benchmark.options if option.for_run} <= keywords


def test_the_inspect_bench_samples_are_valid_and_the_long_one_straddles_a_refit() -> None:
    from pipeline.inspect.tokens import render_tokens
    from pipeline.samples.archive import sample_record

    long = inspect_bench.long_sample(64, 4, vocab=1024)
    assert len(long.token_ids) == 64 and all(256 <= i < 1024 for i in long.token_ids)
    assert render_tokens(sample_record(long, inspect_bench.RUN_ID), None).straddles == 1
    small = [inspect_bench.small_sample(i) for i in range(8)]
    assert len({s.rollout_id for s in small}) == 8 and len({s.group_id for s in small}) == 2


def test_thread_cpu_is_read_per_thread_name() -> None:
    """``bench vllm`` splits the worker's CPU by thread: a busy thread shows up under its
    name, and a pool of threads named alike is one entry."""
    libc = ctypes.CDLL(None)
    done, started = threading.Event(), threading.Barrier(5)  # four threads and this one

    def run_as(name: str, busy_s: float) -> None:
        libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: Python 3.11 leaves the process's
        end = time.thread_time() + busy_s
        while time.thread_time() < end:
            pass
        started.wait()
        done.wait()

    threads = [threading.Thread(target=run_as, args=("spinner", 0.2))]
    threads += [threading.Thread(target=run_as, args=(f"pool-{i}", 0.0)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        started.wait()
        seen = thread_cpu_s(os.getpid())
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert seen["spinner"] >= 0.15, seen
    assert "pool-#" in seen and not any(name.startswith("pool-") and name != "pool-#" for name in seen), seen
    assert thread_cpu_s(2**22 + 1) == {}  # no such process


def test_vllm_summary_pairs_each_round_by_mode() -> None:
    """Ratios divide trials of one round and ack policy, never across rounds."""
    speeds = {
        ("staged", 0): (100.0, 90.0, 81.0),
        ("staged", 1): (200.0, 100.0, 50.0),
        ("enqueued", 0): (10.0, 10.0, 9.0),
    }
    cpu = {"off": (2.0, 20.0), "logprobs": (5.0, 24.0), "on": (5.5, 24.5)}  # API process, engine core
    trials = [
        {
            "ack": ack,
            "logprob_path": path,
            "round": number,
            "mode": mode,
            "tokens_per_s": speed if path == "vllm" else speed * 2,
            "cpu_ms_per_call": {
                "worker": cpu[mode][0] - (2.0 if path == "sampled" and mode == "on" else 0.0),
                "engine_core": cpu[mode][1] + number,
            },
        }
        for path in ("vllm", "sampled")
        for (ack, number), values in speeds.items()
        for mode, speed in zip(vllm.MODES, values, strict=True)
    ]
    summary = vllm.summarize(trials)
    assert summary["ratios"] == {"enqueued": [0.9], "staged": [0.81, 0.25]}
    assert summary["by_ack"] == {"enqueued": 0.9, "staged": 0.53}
    assert summary["capture_over_off_median"] == 0.81
    assert summary["capture_over_logprobs_median"] == 0.9  # 0.9, 0.5, 0.9
    assert summary["capture_cpu_ms_per_call"] == 8.0  # the first path's: (5.5 - 2) + (24.5 - 20)
    assert summary["by_path"]["sampled"]["capture_cpu_ms_per_call"] == 6.0
    assert summary["by_path"]["sampled"]["capture_cpu_ms_per_call_by_process"] == {
        "worker": 1.5,
        "engine_core": 4.5,
    }


def test_vllm_cpu_chart_is_drawn_per_path_and_mode(tmp_path: Path) -> None:
    from bench.plots import cpu_per_call

    trials = [
        {"logprob_path": path, "mode": mode, "cpu_ms_per_call": {"worker": 2.0, "engine_core": 18.0}}
        for path in ("sampled", "vllm")
        for mode in vllm.MODES
    ]
    assert cpu_per_call({"trials": trials}, tmp_path / "cpu.png").read_bytes().startswith(PNG)


def test_quotas_summary_pairs_each_round_per_gateway_and_flooder() -> None:
    """Flooded over alone divides the two trials of one round on one gateway, per flooder."""
    p50 = {
        ("max_in_flight=8", "sandbox", 0): (100.0, 150.0),
        ("max_in_flight=8", "sandbox", 1): (200.0, 200.0),
        ("max_in_flight=8", "same-process", 0): (100.0, 300.0),
        ("unlimited", "sandbox", 0): (100.0, 400.0),
    }
    trials = [
        {"gateway": gateway, "flooder": flooder, "round": number, "mode": mode, "latency_ms": {"p50": value}}
        for (gateway, flooder, number), values in p50.items()
        for mode, value in zip(("alone", "flooded"), values, strict=True)
    ]
    summary = quotas.summarize(trials)
    assert summary["ratios"] == {
        "max_in_flight=8, sandbox flooder": [1.5, 1.0],
        "max_in_flight=8, same-process flooder": [3.0],
        "unlimited, sandbox flooder": [4.0],
    }
    assert summary["flooded_over_alone"]["max_in_flight=8, sandbox flooder"] == 1.25
    assert summary["p50_ms"]["max_in_flight=8, sandbox flooder, alone"] == 150.0  # median of 100, 200
    assert summary["p50_ms"]["unlimited, sandbox flooder, flooded"] == 400.0


def test_quotas_report_shows_slot_waits_and_slots_per_trial() -> None:
    trial = {
        "gateway": "max_in_flight=8, worker_slots=learned",
        "flooder": "same-process",
        "round": 0,
        "latency_ms": {"p50": 100.0, "p99": 120.0},
        "flood_answers": {},
        "slot_waits": 0,
        "worker_slots": 3,
        "cpu_s": {"gateway": 0.1, "worker": 0.2, "engine_core": 1.5, "flooder": 0.0},
    }
    off = {**trial, "gateway": "max_in_flight=8, worker_slots=off", "worker_slots": None}
    trials = [{**t, "mode": mode} for t in (trial, off) for mode in ("alone", "flooded")]
    table = quotas.render({"trials": trials, "summary": quotas.summarize(trials)})
    assert "| alone | 100.0 / 120.0 | - | 0 | 3 | 0.1 · 0.2 · 1.5 · 0.0 |" in table
    assert (
        "| max_in_flight=8, worker_slots=off | same-process | 0 | alone | 100.0 / 120.0 | - | 0 | - |"
        in table
    )
    assert "| max_in_flight=8, worker_slots=learned, same-process flooder, alone | 100.0 |" in table


def test_quotas_names_the_gateway_s_slot_settings() -> None:
    """The default gateway runs without the flag; off is 0; a number is passed on."""
    assert quotas.worker_slots("learned") is None
    assert quotas.worker_slots("off") == 0
    assert quotas.worker_slots("4") == 4
    parsed = cli.build_parser().parse_args(["bench", "quotas", "--worker-slots", "learned,off,2"])
    assert quotas.BENCHMARK.config(parsed).worker_slots == ("learned", "off", "2")
    with pytest.raises(ValueError, match="worker_slots: \\['0'\\]; choose learned, off or a number > 0"):
        quotas.QuotaBenchConfig(worker_slots=("0",))


def test_quotas_refuses_an_unknown_flooder() -> None:
    with pytest.raises(ValueError, match="flooders: \\['nearby'\\]; choose from sandbox, same-process"):
        quotas.QuotaBenchConfig(flooders=("nearby",))


def test_splice_bench_smallest_configuration() -> None:
    """The splice bench at 10 turns reports both templates' costs (what they compare to is
    bench/RESULTS.md's business; which path the splice takes is tested in the unit tests)."""
    from bench import splice

    parsed = cli.build_parser().parse_args(["bench", "splice", "--quick", "--turns", "10", "--rounds", "1"])
    config = splice.BENCHMARK.config(parsed)
    assert config == splice.SpliceBenchConfig(turns=(10,), rounds=1, calls=5)
    rows = {row["template"]: row for row in splice.run(config)["rows"]}
    assert rows.keys() == {"chatml", "strip_reasoning"}
    assert all(row["turns"] == 10 and row["prompt_tokens"] > 100 for row in rows.values())
    assert all(row["vllm_render_ms"] > 0 and row["splice_ms"] >= 0 for row in rows.values())


def test_digest_smallest_configuration() -> None:
    from bench import digest

    config = quick_config("digest")
    assert config == digest.DigestConfig(sizes=(1_000,))
    report = digest.run(config)
    (row,) = report["results"]
    assert report["benchmark"] == "digest" and row["tokens"] == 1_000
    figures = ("cumulative_hash_list_MBps", "cumulative_hash_numpy_MBps", "row_records_per_s", "row_us")
    assert all(row[figure] > 0 for figure in figures)
    assert "| 1,000 |" in digest.render(report)


def test_capture_hook_smallest_configuration() -> None:
    from bench import capture_hook

    config = quick_config("capture-hook", "--sizes", "64", "--repeats", "3")
    assert config == capture_hook.CaptureHookConfig(sizes=(64,), repeats=3)
    report = capture_hook.run(config)
    (row,) = report["results"]
    assert report["benchmark"] == "capture_hook" and row["tokens"] == 64
    assert row["hook_us"] > 0 and row["hashing_us"] > 0
    assert row["hook_minus_hashing_us"] == round(row["hook_us"] - row["hashing_us"], 1)
    assert "| 64 |" in capture_hook.render(report)


def test_megatron_hooks_smallest_configuration() -> None:
    from bench import megatron_hooks

    config = quick_config("megatron-hooks", "--sizes", "64", "--repeats", "4")
    assert config == megatron_hooks.MegatronHooksConfig(sizes=(64,), repeats=4)
    report = megatron_hooks.run(config)
    (row,) = report["results"]
    assert report["benchmark"] == "megatron_hooks" and report["repeats"] == 4
    assert (row["tokens"], row["delta_tokens"]) == (64, 32)
    for name in megatron_hooks.TIMINGS:
        assert row[name]["median_us"] >= row[name]["min_us"] > 0
    assert row["hashing_MBps"] > 0 and row["hashed_MB"] > 0
    assert len(megatron_hooks.render(report).splitlines()) == 2 + len(megatron_hooks.TIMINGS) + 1


@pytest.mark.broker
def test_kafka_events_smallest_configuration() -> None:
    """Every event produced (the backlog and the ones published alone) is consumed once."""
    from bench import kafka_events

    config = quick_config("kafka-events", "--events", "60", "--publish-batch", "20", "--partitions", "2")
    assert config == kafka_events.KafkaEventsConfig(events=60, partitions=2, publish_batch=20)
    report = kafka_events.run(config)
    assert (report["events"], report["partitions"], report["consumed"]) == (60, 2, 120)
    rates = ("encode_events_per_s", "decode_events_per_s", "produce_events_per_s", "consume_events_per_s")
    assert all(report[rate] > 0 for rate in rates) and report["mean_value_bytes"] > 0
    assert report["publish_one_p99_ms"] >= report["publish_one_p50_ms"] > 0 and report["group_join_s"] >= 0
    assert "tansu" in report["versions"] and "consumed: 120" in kafka_events.render(report)


@pytest.mark.dataplane
def test_dataplane_smallest_configuration() -> None:
    from bench import dataplane

    config = quick_config("dataplane", "--tokens", "64", "--rows", "8", "--batch", "4")
    assert config == dataplane.DataPlaneBenchConfig(placements=("embedded",), tokens=(64,), batch=4, rows=8)
    report = dataplane.run(config)
    assert (report["batch"], report["rows_per_case"]) == (4, 8) and list(report["results"]) == ["embedded"]
    (case,) = report["results"]["embedded"]
    assert case["tokens"] == 64 and case["bytes_per_row"] > 16 * 64  # 16 bytes a token plus metadata
    for name in dataplane.CASES:
        numbers = case[name]
        assert numbers["calls"] == (8 if "single" in name else 2)
        assert numbers["rows_per_s"] > 0 and numbers["mb_per_s"] > 0 and numbers["cpu_us_per_row"] >= 0
        assert numbers["p99_ms"] >= numbers["p50_ms"] > 0
    assert min(case["codec_rows_per_s"].values()) > 0
    assert len(dataplane.render(report).splitlines()) == 2 + len(dataplane.CASES)


def test_dataplane_refuses_an_unknown_placement() -> None:
    from bench import dataplane

    with pytest.raises(ValueError, match="placements: \\['remote'\\]; choose from embedded, separate"):
        dataplane.DataPlaneBenchConfig(placements=("remote",))


def test_amplification_smallest_configuration() -> None:
    """A small grid on the real capture path and stages: every verdict agrees with the driver."""
    from bench import amplification

    config = quick_config("amplification", "--calls", "4", "--fail", "0.2,0.3", "--rollouts", "12")
    assert config == amplification.AmplificationConfig(calls=(4,), fail=(0.2, 0.3), rollouts=12)
    report = amplification.run(config)
    assert [(r["calls_per_rollout"], r["fail"], r["rollouts"]) for r in report["results"]] == [
        (4, 0.2, 12),
        (4, 0.3, 12),
    ]
    for r in report["results"]:
        assert r["calls"] >= 12 and 0 < r["fail_closed_expected_share"] < 1 and r["rows_left"] == 0
        assert r["rejected"] == r["terminal_hit"] and r["survived"] <= r["any_failed"] <= r["rollouts"]
    assert amplification.disagreements(report) == [] and "| 4 | 20.0% | 12 |" in amplification.render(report)


def test_amplification_names_each_wrong_verdict() -> None:
    from bench import amplification

    result = {
        "calls_per_rollout": 16,
        "fail": 0.01,
        "rollouts": 3,
        "wrongly_rejected": [],
        "inexact_samples": [],
    }
    report = {"results": [result | {"wrongly_accepted": ["a-1", "a-2"]}]}
    assert amplification.disagreements(report) == [
        "16 calls, 1.0% failing: 2 accepted although the terminal chain was hit, e.g. a-1, a-2"
    ]


def test_amplification_refuses_a_loss_probability_of_one() -> None:
    from bench import amplification

    with pytest.raises(ValueError, match="fail: each must be in"):
        amplification.AmplificationConfig(fail=(0.5, 1.0))
    assert len(amplification.AmplificationConfig(rollouts=7).configs()) == len(amplification.DEFAULT_CONFIGS)


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.dataplane
def test_soak_smallest_configuration() -> None:
    from bench import soak

    report = soak.run(soak.SoakConfig(minutes=0.25, sample_every_s=3.0))
    assert report["benchmark"] == "soak" and report["rollouts"] > 0 and report["calls"] > report["rollouts"]
    assert {"ledger", "finalizer", "dataplane", "worker", "owner", "broker"} <= set(report["processes"])
    assert set(report["lag"]) == {"ledger", "finalizer", "owner"}
    assert all(lag["after_drain"] == 0 for lag in report["lag"].values())  # the owner took every sample
    assert report["disk_bytes_per_call"]["log"] is None  # a memory broker writes no log to disk
    assert report["restarts"] == {} and "ledger" in soak.render(report)


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.dataplane
def test_log_trip_smallest_configuration() -> None:
    from bench import log_trip
    from pipeline.kafka.embedded.broker import MEMORY_LOG_MARGIN_MS

    report = log_trip.run(log_trip.LogTripConfig(minutes=0.15, storage="memory", concurrency=2))
    trip = report["trip_ms"]
    assert report["benchmark"] == "log-trip" and report["records"] > 0
    assert 0 < trip["p50"] <= trip["p99"] <= trip["p99.9"] <= trip["max"]
    assert sum(minute["records"] for minute in report["by_minute"]) == report["records"]
    assert report["margin_ms"] == MEMORY_LOG_MARGIN_MS
    assert report["within_margin"] == (trip["max"] < MEMORY_LOG_MARGIN_MS)
    assert "merge margin" in log_trip.render(report)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.broker
@pytest.mark.dataplane
def test_gateway_soak_smallest_configuration() -> None:
    from bench import gateway_soak

    config = gateway_soak.GatewaySoakConfig(minutes=0.25, sample_every_s=3.0, agents=2)
    report = gateway_soak.run(config)
    assert report["benchmark"] == "gateway-soak" and report["rollouts"] > 0 and report["failed"] == 0
    assert set(report["processes"]) == {"gateway", "worker", "engine_core", "dataplane"}
    gateway = report["processes"]["gateway"]
    assert {"slope_mib_per_10k_rollouts", "slope_by_half_mib_per_10k_rollouts", "rss_mib_last"} <= set(
        gateway
    )
    assert len(gateway["slope_by_half_mib_per_10k_rollouts"]) == 2
    assert "gateway" in gateway_soak.render(report)


def test_soak_slope_is_least_squares_per_finished_rollout() -> None:
    from bench import soak

    assert soak.slope([0, 1, 2, 3], [5.0, 7.0, 9.0, 11.0]) == 2.0
    assert soak.slope([4], [1.0]) is None and soak.slope([4, 4], [1.0, 2.0]) is None
    samples = [
        {
            "at_s": 10.0 * i,
            "finished": 1000 * i,
            "calls": 17000 * i,
            "lag": {"ledger": i, "finalizer": 0},
            "rss_mib": {"ledger": 60.0 + 0.01 * i},
            "cpu_s": {"ledger": 1.0 * i},
            "log_bytes": 0,
            "spool_bytes": 100 * i,
            "ledger_inputs": 100 * i + 10,
            "heap": {
                "ledger": {
                    "blocks": 1000.0 + 2 * i,
                    "full_collections": i // 5,
                    "open_rollouts": 5.0,
                    "events_in": 100.0 * i,
                }
            },
        }
        for i in range(1, 10)
    ]
    samples[4]["heap"] = {}  # a stage restarting: that sample goes without it
    report = soak._report(soak.SoakConfig(minutes=1.5), samples, {}, {"ledger": 0, "finalizer": 0})
    ledger = report["processes"]["ledger"]
    assert ledger["slope_mib_per_10k_rollouts"] == 0.1 and ledger["cpu_ms_per_rollout"] == 1.0
    for i, sample in enumerate(samples, start=1):  # filling over the first half, then flat
        sample["rss_mib"] = {"ledger": 60.0 + 0.01 * min(i, 5)}
    halves = soak._report(soak.SoakConfig(minutes=1.5), samples, {}, {})["processes"]["ledger"]
    assert halves["slope_by_half_mib_per_10k_rollouts"] == [0.1, 0.0]
    assert ledger["blocks_slope_per_10k_rollouts"] == 20 and ledger["full_collections"] == 1
    assert ledger["blocks_first"] == 1002.0 and ledger["blocks_last"] == 1018.0
    assert ledger["unread_by_third"] == [10.0, 10.0, 10.0]
    assert report["lag"]["ledger"]["mean_by_third"] == [2.0, 5.0, 8.0] and report["lag"]["ledger"]["max"] == 9


def test_tq_controller_ceiling_is_operations_per_controller_cpu_second() -> None:
    """CPU per operation by role comes from the data plane's CPU around a sweep point; the
    ceiling is one controller core's operations per second, and a call is a put, a get and
    a delete of its row."""
    from bench import tq_controller

    def point(operation: str, controller_s: float, request_s: float) -> dict[str, Any]:
        clients = [{"ops": 500, "wall_s": 2.0, "cpu_s": 0.5, "latencies": [0.001, 0.003]}] * 2
        before = {"request": 1.0, "controller": 2.0, "storage": 3.0, "process": 10.0}
        after = {
            "request": 1.0 + request_s,
            "controller": 2.0 + controller_s,
            "storage": 3.2,
            "process": 10.2 + controller_s + 0.1,
        }
        return tq_controller.summarize(operation, clients, before, after)

    put = point("put", 1.0, 0.9)
    assert put["ops"] == 1000 and put["ops_per_s"] == 500.0 and put["clients"] == 2
    assert put["cpu_us_per_op"] == {
        "controller": 1000.0,
        "request_thread": 900.0,
        "storage": 200.0,
        "rest_of_process": 100.0,
        "clients": 1000.0,
    }
    assert put["request_thread_busy"] == 0.45 and put["ceiling_ops_per_core"] == 1000
    points = [put, point("get", 0.25, 0.2), point("meta", 0.2, 1.9), point("delete", 0.75, 0.7)]
    summary = tq_controller.summary(points, batch=1)
    assert summary["controller_us_per_call"] == 2000.0 and summary["ceiling_calls_per_core"] == 500
    assert summary["dense_case_controller_cores"] == 20.0
    assert summary["request_thread_busy_max"] == 0.95 and summary["saturated"]
    assert tq_controller.summary(points, batch=4)["ceiling_calls_per_core"] == 2000
    assert tq_controller.ceiling(0.0) == 0.0


def test_named_threads_give_transferqueue_threads_their_roles() -> None:
    from bench import named_threads

    assert named_threads.role("TransferQueueControllerProcessRequestThread") == named_threads.REQUEST_THREAD
    assert named_threads.role("StorageUnitWorkerThread-TQ_STORAGE_UNIT_1a2b") == "tq-su-worker"
    assert named_threads.role("tq-ssd-read_0") == "tq-su-disk" and named_threads.role("MainThread") is None
    assert (
        named_threads.zmq_role(100, 102) == "tq-ctl-zmq" and named_threads.zmq_role(104, 102) == "tq-su-zmq"
    )
    labels = [label for _, label in named_threads.ROLES] + ["tq-ctl-zmq", "tq-su-zmq"]
    assert all(len(label) <= 15 and not any(c.isdigit() for c in label) for label in labels)  # kernel names
