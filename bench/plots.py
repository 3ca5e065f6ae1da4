"""Plots for ``bench/RESULTS.md``: engine throughput vs data-plane delay, latency CDFs,
capture's CPU per call by process, the pipeline's CPU per call by process across runs,
the learning curves.

matplotlib with the Agg backend (no display); imported only when a plot is asked for.
No benchmark (it measures nothing): ``bench engine``, ``bench pipeline``, ``bench vllm`` and
``bench learning`` call its functions for their ``--plot``. The pipeline chart compares reports saved by
separate runs (say, two commits measured alternately), which no one run of a benchmark
holds, so it keeps a command line of its own (argparse) to draw them:

    python -m bench.plots pipeline-cpu --out FILE.png LABEL=REPORT.json [LABEL=REPORT.json ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MODE_STYLE = {
    "off": ("capture off", "tab:gray", "o"),
    "inline": ("inline (upstream style)", "tab:red", "s"),
    "tokentrail": ("tokentrail", "tab:blue", "^"),
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def engine_throughput(report: dict[str, Any], path: str | Path) -> Path:
    """One panel per finishing rate: tokens/s of each mode against the injected delay."""
    plt = _pyplot()
    cells = report["cells"]
    rates = sorted({c["finishing"] for c in cells})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.6 * len(rates), 4.2), squeeze=False, sharey=True)
    for ax, rate in zip(axes[0], rates, strict=True):
        mine = sorted((c for c in cells if c["finishing"] == rate), key=lambda c: c["latency_ms"])
        labels = [f"+{c['latency_ms']:g} ms" if c["injected"] else "real" for c in mine]
        for mode, (label, color, marker) in MODE_STYLE.items():
            values = [c["modes"][mode]["tokens_per_s"] for c in mine]
            ax.plot(labels, values, marker=marker, color=color, label=label)
        ax.set_title(f"{rate} request(s) finishing per step")
        ax.set_xlabel("data-plane delay per call")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("engine tokens/s")
    axes[0][0].set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(MODE_STYLE), frameon=False)
    probe = report.get("data_plane_ms", {})
    fig.suptitle(
        "Engine throughput vs data-plane latency "
        f"(real put/get p50 {probe.get('put_p50', '?')}/{probe.get('get_p50', '?')} ms)"
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, plt, path)


def latency_cdf(report: dict[str, Any], path: str | Path) -> Path:
    """One panel per rollout length: seal-to-finalized CDF per mode and number of stage instances."""
    plt = _pyplot()
    results = report["results"]
    lengths = sorted({r["calls_per_rollout"] for r in results})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.6 * len(lengths), 4.2), squeeze=False, sharey=True)
    target = report.get("summary", {}).get("target_p99_ms")
    for ax, length in zip(axes[0], lengths, strict=True):
        for r in sorted(
            (r for r in results if r["calls_per_rollout"] == length),
            key=lambda r: (r.get("mode", "inline"), r["instances"]),
        ):
            points = r["latency"]["cdf_ms"]
            if not points:
                continue
            levels = [i / (len(points) - 1) for i in range(len(points))]
            offered = r["latency"]["offered_calls_per_s"]
            label = f"{r.get('mode', 'inline')}, {r['instances']} instance(s), {offered:,.0f} calls/s"
            ax.plot(points, levels, label=label)
        if target is not None:
            ax.axvline(
                target, color="tab:red", linestyle="--", linewidth=1, label=f"target p99 {target:g} ms"
            )
        ax.axhline(0.99, color="gray", linestyle=":", linewidth=1)
        ax.set_title(f"{length} calls per rollout")
        ax.set_xlabel("seal → finalized (ms)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    axes[0][0].set_ylabel("fraction of rollouts")
    fig.suptitle("Finalize latency after seal (ledger + finalizer, embedded broker and TransferQueue)")
    fig.tight_layout()
    return _save(fig, plt, path)


CPU_PARTS = (("worker", "API process", "tab:blue"), ("engine_core", "engine core", "tab:orange"))


def cpu_per_call(report: dict[str, Any], path: str | Path) -> Path:
    """``bench vllm``: CPU ms per call of the API process and the engine core (stacked,
    median of rounds) for each logprob path and mode, side by side."""
    plt = _pyplot()
    trials = report["trials"]
    paths = list(dict.fromkeys(t["logprob_path"] for t in trials))
    modes = list(dict.fromkeys(t["mode"] for t in trials))
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(paths) * len(modes), 4.4))
    labels: list[str] = []
    for x, (logprob_path, mode) in enumerate((p, m) for p in paths for m in modes):
        chosen = [t for t in trials if t["logprob_path"] == logprob_path and t["mode"] == mode]
        bottom = 0.0
        for role, name, color in CPU_PARTS:
            height = statistics.median(t["cpu_ms_per_call"][role] for t in chosen)
            ax.bar(x, height, bottom=bottom, color=color, label=name if x == 0 else None)
            bottom += height
        labels.append(f"{logprob_path}\n{mode}")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("CPU ms per call (median of rounds)")
    ax.set_title("Capture's CPU by process: capture's sampled-logprob path vs vLLM's")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    return _save(fig, plt, path)


PIPELINE_PARTS = (
    ("finalizer", "finalizer", "tab:blue"),
    ("ledger", "ledger", "tab:orange"),
    ("bench", "TransferQueue + publisher", "tab:green"),
    ("broker", "broker", "tab:gray"),
)


def pipeline_cpu_ms_by_role(result: dict[str, Any]) -> dict[str, float]:
    """``bench pipeline``: one run's CPU ms per backlog call, by role (instances summed)."""
    by_role: dict[str, float] = {}
    for name, seconds in result["cpu_s"].items():
        role = name.split("-", 1)[0]  # finalizer-0, ledger-1, ...
        by_role[role] = by_role.get(role, 0.0) + seconds * 1000 / result["backlog"]["calls"]
    return by_role


def pipeline_cpu_per_call(reports: Mapping[str, Sequence[dict[str, Any]]], path: str | Path) -> Path:
    """``bench pipeline`` reports under labels: CPU ms per call by process (stacked, the
    median over each label's runs of the first configuration), label beside label."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.8 + 1.4 * len(reports), 4.4))
    for x, runs in enumerate(reports.values()):
        parts = [pipeline_cpu_ms_by_role(report["results"][0]) for report in runs]
        bottom = 0.0
        for role, name, color in PIPELINE_PARTS:
            height = statistics.median(part.get(role, 0.0) for part in parts)
            ax.bar(x, height, bottom=bottom, color=color, label=name if x == 0 else None)
            bottom += height
        ax.annotate(f"{bottom:.2f}", (x, bottom), ha="center", va="bottom", fontsize="small")
    ax.set_xticks(range(len(reports)), list(reports))
    ax.set_ylabel("CPU ms per call (median of runs)")
    ax.set_title("Pipeline CPU per call by process")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, fontsize="small")
    fig.tight_layout()
    return _save(fig, plt, path)


def learning_curves(curves: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """``bench learning``: mean reward per training step, one line per trainer."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for row in curves:
        ax.plot(range(1, len(row["rewards"]) + 1), row["rewards"], marker="o", label=row["label"])
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward (share of digits)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def _labelled(values: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """``LABEL=REPORT.json`` arguments, grouped by label in the order first given."""
    reports: dict[str, list[dict[str, Any]]] = {}
    for value in values:
        label, sep, file = value.partition("=")
        if not sep or not label or not file:
            raise SystemExit(f"bench.plots: {value!r} is not LABEL=REPORT.json")
        reports.setdefault(label, []).append(json.loads(Path(file).read_text()))
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__)
    which = parser.add_subparsers(dest="plot", required=True)
    pipeline = which.add_parser(
        "pipeline-cpu", help="CPU per call by process of saved bench pipeline reports"
    )
    pipeline.add_argument("--out", required=True, help="PNG to write")
    pipeline.add_argument("reports", nargs="+", metavar="LABEL=REPORT.json")
    args = parser.parse_args(argv)
    print(pipeline_cpu_per_call(_labelled(args.reports), args.out))
    return 0


__all__ = ["cpu_per_call", "engine_throughput", "latency_cdf", "pipeline_cpu_per_call"]

if __name__ == "__main__":
    sys.exit(main())
