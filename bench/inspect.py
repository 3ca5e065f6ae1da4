"""The inspector in a real browser: time to first render of the rollout table and a 32K-token view.

A generated data directory (no run needed): the tiny model's tokenizer and a sample
archive written through the archive's own writer, ``--rollouts`` small samples (8
tokens, groups of 4) and one ``--long-tokens`` sample of ids valid for that tokenizer,
in ``--calls`` calls, the middle one straddling a refit. With no event log the
inspector's table lists the archived rollouts, so the archive alone gives the table its
rows. A real ``tokentrail inspect`` process serves it; Debian's chromium, driven by
Playwright, opens each page ``--trials`` times in a fresh tab and reads the browser's
own timings: the navigation entry (request → response start, → DOMContentLoaded, →
load), first-contentful-paint and the document's bytes. Pages: ``/rollouts``,
``/rollouts?page=1000`` and the long sample's ``/samples/KEY/tokens``; on the token
view, a real mouse hover on its last token, timed from the ``mouseover`` event's own
timestamp to its dispatch (the page's first listener), the tooltip's change and the
next animation frame.

    tokentrail bench inspect [--quick] [--json] [--rollouts 100000] [--long-tokens 32768]

``summary`` has the median of each timing per page, in ms; the first trial of the table
includes sorting it (each order is computed once per process).
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.command import Benchmark, Option, Quick
from bench.common import machine, versions
from pipeline.kafka.embedded.broker import free_port
from pipeline.run.config import TINY_MODEL_DIR_NAME
from pipeline.samples.archive import SampleArchive, archive_path, sample_record
from topics import digest
from topics.records import TrainingSample

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
)
RUN_ID = "run-20250101-000000-abcdef"
LONG_KEY = f"{RUN_ID}.long.0"
TARGET_LOAD_MS = 2000.0
"""The token view of a 32K-token sample should be loaded within this."""

NAVIGATION = """() => {
    const nav = performance.getEntriesByType("navigation")[0];
    const paint = performance.getEntriesByName("first-contentful-paint")[0];
    return {
        response_start: nav.responseStart - nav.startTime,
        response_end: nav.responseEnd - nav.startTime,
        dom_content_loaded: nav.domContentLoadedEventEnd - nav.startTime,
        load: nav.loadEventEnd - nav.startTime,
        first_contentful_paint: paint ? paint.startTime : null,
        bytes: nav.encodedBodySize,
        elements: document.getElementsByTagName("*").length,
    };
}"""

WATCH_HOVER = """() => {
    const last = [...document.querySelectorAll("#tokens [data-token-id]")].pop();
    last.scrollIntoView({block: "center"});
    window.__hover = {};
    document.addEventListener("mouseover", (e) => {
        if (e.target === last) { window.__hover = {event: e.timeStamp, dispatched: performance.now()}; }
    }, true);
    new MutationObserver(() => {
        const h = window.__hover;
        if (h.event === undefined || h.updated !== undefined) { return; }
        h.updated = performance.now();
        requestAnimationFrame(() => { h.frame = performance.now(); });
    }).observe(document.getElementById("tip"), {childList: true, characterData: true, subtree: true});
    return last.dataset.tokenId;
}"""


@dataclass(frozen=True, slots=True)
class InspectBenchConfig:
    rollouts: int = 100_000
    long_tokens: int = 32_768
    calls: int = 8
    """Calls of the long sample."""
    trials: int = 5
    hovers: int = 5
    page: int = 1000
    """The deep table page measured beside the first."""


QUICK = Quick(
    "10,000 rollouts, an 8K sample, 2 trials",
    InspectBenchConfig(rollouts=10_000, long_tokens=8192, trials=2, hovers=2, page=100),
)
OPTIONS = (
    Option("--rollouts", "small archived rollouts (default 100000)", int),
    Option("--long-tokens", "tokens of the long sample (default 32768)", int),
    Option("--calls", "calls of the long sample (default 8)", int),
    Option("--trials", "times each page is opened (default 5)", int),
    Option("--hovers", "hovers timed on the last token (default 5)", int),
    Option("--page", "the deep table page measured (default 1000)", int),
)


def small_sample(i: int) -> TrainingSample:
    ids = [300 + (i + j) % 700 for j in range(8)]
    return TrainingSample.model_validate(
        {
            "rollout_id": f"{RUN_ID}.t{i // 4}.{i % 4}",
            "group_id": f"{RUN_ID}.t{i // 4}",
            "token_ids": ids,
            "token_mask": [0.0] * 4 + [1.0] * 4,
            "logprobs": [0.0] * 4 + [-0.05 * (1 + i % 20)] * 4,
            "weight_versions": [i // 1000] * 8,
            "spans": [{"call_id": f"c{i}", "start": 0, "carry_len": 4, "gen_len": 4}],
            "reward": float(i % 2),
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )


def long_sample(tokens: int, calls: int, vocab: int) -> TrainingSample:
    """``calls`` calls of a quarter carried prompt, three quarters generated; the middle
    call's second half sampled by the next weight version (a refit straddle)."""
    rng = random.Random(0)
    per_call = tokens // calls
    ids = [rng.randrange(256, vocab) for _ in range(tokens)]
    mask: list[float] = []
    versions: list[int] = []
    spans = []
    for call in range(calls):
        start = call * per_call
        length = per_call if call < calls - 1 else tokens - start
        carry = length // 4
        spans.append({"call_id": f"c{call}", "start": start, "carry_len": carry, "gen_len": length - carry})
        mask += [0.0] * carry + [1.0] * (length - carry)
        version = 0 if call <= calls // 2 else 1
        versions += [version] * length
        if call == calls // 2:
            versions[start + length // 2 : start + length] = [1] * (length - length // 2)
    logprobs = [0.0 if m == 0 else -rng.expovariate(2.0) for m in mask]
    return TrainingSample.model_validate(
        {
            "rollout_id": LONG_KEY,
            "group_id": f"{RUN_ID}.long",
            "token_ids": ids,
            "token_mask": mask,
            "logprobs": logprobs,
            "weight_versions": versions,
            "spans": spans,
            "reward": 1.0,
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )


def make_data_dir(root: Path, config: InspectBenchConfig) -> Path:
    """The tiny model and an archive of ``config.rollouts`` small samples plus the long one."""
    from tokenizers import Tokenizer

    data_dir = root / "data"
    model = data_dir / TINY_MODEL_DIR_NAME
    cli = [sys.executable, "-m", "pipeline.cli"]
    subprocess.run([*cli, "make-tiny-model", str(model)], check=True, stdout=subprocess.DEVNULL)
    vocab = Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab_size()
    with SampleArchive(archive_path(data_dir)) as archive:
        for i in range(config.rollouts):
            archive.append(sample_record(small_sample(i), RUN_ID))
        archive.append(sample_record(long_sample(config.long_tokens, config.calls, vocab), RUN_ID))
    return data_dir


@contextmanager
def inspector(data_dir: Path, log: Path) -> Iterator[tuple[str, float]]:
    """``tokentrail inspect`` on a free port; its URL and the seconds until /health answered."""
    port = free_port()
    began = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "inspect", str(data_dir), "--port", str(port)],
            stdout=out,
            stderr=out,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"inspect exited {process.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.1)
        yield url, time.perf_counter() - began
    finally:
        process.terminate()
        process.wait(30)


def navigate(context: Any, url: str) -> tuple[Any, dict[str, Any]]:
    """A fresh tab opened on ``url``; the page and the browser's timings of it."""
    page = context.new_page()
    page.goto(url, wait_until="load")
    page.wait_for_function("performance.getEntriesByType('navigation')[0].loadEventEnd > 0")
    page.wait_for_function(
        "performance.getEntriesByName('first-contentful-paint').length > 0"
    )  # may follow load
    timings: dict[str, Any] = page.evaluate(NAVIGATION)
    return page, timings


def hover_times(page: Any, hovers: int) -> list[dict[str, float]]:
    """Real mouse moves onto the last token, each from another token; ms from the event."""
    last_id = page.evaluate(WATCH_HOVER)
    tokens = page.locator("#tokens [data-token-id]")
    last = tokens.last
    away = tokens.nth(tokens.count() - 40)
    times = []
    for _ in range(hovers):
        away.hover()
        page.evaluate("window.__hover = {}")
        last.hover()
        page.wait_for_function("window.__hover.frame !== undefined")
        assert page.locator("#tip").get_attribute("data-token-id") == last_id
        h = page.evaluate("window.__hover")
        times.append(
            {
                "dispatched": h["dispatched"] - h["event"],
                "tooltip": h["updated"] - h["event"],
                "next_frame": h["frame"] - h["event"],
            }
        )
    return times


def median(trials: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [t[key] for t in trials if t.get(key) is not None]
    return round(statistics.median(values), 1) if values else None


def run(config: InspectBenchConfig | None = None) -> dict[str, Any]:
    """Build the data directory, start the inspector, then time each page in chromium."""
    from playwright.sync_api import sync_playwright

    config = config or InspectBenchConfig()
    load_before = machine()
    pages = {
        "rollouts": "/rollouts",
        f"rollouts page {config.page}": f"/rollouts?page={config.page}",
        f"tokens ({config.long_tokens})": f"/samples/{LONG_KEY}/tokens",
    }
    trials: list[dict[str, Any]] = []
    hovers: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-inspect-") as scratch:
        root = Path(scratch)
        began = time.perf_counter()
        data_dir = make_data_dir(root, config)
        generate_s = time.perf_counter() - began
        archive_mib = archive_path(data_dir).stat().st_size / 2**20
        with (
            inspector(data_dir, root / "inspect.log") as (url, startup_s),
            sync_playwright() as playwright,
        ):
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=list(CHROMIUM_ARGS))
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            for number in range(config.trials):
                for name, path in pages.items():
                    page, timings = navigate(context, url + path)
                    trials.append({"page": name, "trial": number, **timings})
                    if name.startswith("tokens") and number == config.trials - 1:
                        hovers = hover_times(page, config.hovers)
                    page.close()
            browser.close()
    summary = {
        name: {
            key: median([t for t in trials if t["page"] == name], key)
            for key in ("response_start", "dom_content_loaded", "load", "first_contentful_paint", "bytes")
        }
        for name in pages
    }
    summary["hover_last_token"] = {
        key: median(hovers, key) for key in ("dispatched", "tooltip", "next_frame")
    }
    return {
        "benchmark": "inspect",
        "config": asdict(config),
        "machine": load_before,
        "load_average_end": machine()["load_average"],
        "versions": {**versions(("playwright", "fastapi", "uvicorn", "jinja2")), "chromium": CHROMIUM},
        "data_dir": {"generate_s": round(generate_s, 1), "archive_mib": round(archive_mib, 1)},
        "inspector_startup_s": round(startup_s, 2),
        "trials": trials,
        "hovers": hovers,
        "summary": summary,
        "target_load_ms": TARGET_LOAD_MS,
    }


def render(report: dict[str, Any]) -> str:
    lines = [
        "| page | response start ms | DOMContentLoaded ms | load ms | first contentful paint ms | document KiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["summary"].items():
        if name == "hover_last_token":
            continue
        lines.append(
            f"| {name} | {s['response_start']} | {s['dom_content_loaded']} | {s['load']} "
            f"| {s['first_contentful_paint']} | {s['bytes'] / 1024:.0f} |"
        )
    hover = report["summary"]["hover_last_token"]
    lines += [
        "",
        f"hover on the last token: dispatched {hover['dispatched']} ms, tooltip {hover['tooltip']} ms, "
        f"next frame {hover['next_frame']} ms after the mouseover event's timestamp (medians); "
        f"inspector up in {report['inspector_startup_s']} s "
        f"over a {report['data_dir']['archive_mib']} MiB archive",
    ]
    return "\n".join(lines)


BENCHMARK = Benchmark("inspect", __doc__, InspectBenchConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
