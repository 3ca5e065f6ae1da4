"""``tokentrail inspect`` as a user meets it: a real subprocess over a real run's data
directory, driven by Debian's chromium through Playwright. A screenshot of each view goes
to ``$TOKENTRAIL_INSPECT_SCREENSHOTS`` (default ``tests/inspect/screenshots/``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from inspectkit import RunDir
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright

from pipeline.inspect.tokens import sampling_label
from pipeline.kafka.embedded.broker import free_port
from pipeline.samples.archive import archive_path, read_archive
from stages.trainer.advantages import group_advantages

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.broker, pytest.mark.dataplane]

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture(scope="module")
def server(run_dir: RunDir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with inspecting(run_dir.path, tmp_path_factory) as url:
        yield url


@contextmanager
def inspecting(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``tokentrail inspect DATA_DIR`` on a free port, its URL once it answers."""
    port = free_port()
    log = tmp_path_factory.mktemp("inspect-server") / "inspect.log"
    with log.open("w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "inspect", str(data_dir), "--port", str(port)],
            cwd=REPO,
            stdout=err,
            stderr=err,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"inspect exited: {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"inspect never answered: {log.read_text()[-3000:]}"
                time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)")
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Browser, server: str, run_dir: RunDir) -> Iterator[Page]:
    """A logged-in page that fails the test on any console error."""
    with logged_in(browser, server, run_dir) as logged:
        yield logged


@contextmanager
def logged_in(browser: Browser, server: str, run_dir: RunDir) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server)
    page = context.new_page()
    errors: list[str] = []

    def watch(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(message.text)

    page.on("console", watch)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    token = (run_dir.path / "credentials" / "operator.token").read_text().strip()
    page.goto(f"{server}/rollouts?token={token}")
    assert page.url == f"{server}/rollouts"  # the token went into a cookie, out of the URL
    yield page
    context.close()
    assert errors == []


def shot(page: Page, screenshots: Path, name: str) -> None:
    page.screenshot(path=str(screenshots / f"{name}.png"), full_page=False)


def samples(run_dir: RunDir) -> dict[str, dict[str, Any]]:
    records = read_archive(archive_path(run_dir.path)).records
    return {str(r.get("sample_key") or r["rollout_id"]): r for r in records}


def test_without_the_operator_credential_it_is_refused(server: str) -> None:
    for path in ("/rollouts", "/pipeline", "/samples/x/tokens"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(server + path, timeout=5)
        assert refused.value.code == 401
    request = urllib.request.Request(
        server + "/rollouts", headers={"cookie": "tokentrail_inspect=" + "x" * 40}
    )
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(request, timeout=5)
    assert wrong.value.code == 401


def test_the_table_lists_pages_and_filters(
    page: Page, server: str, run_dir: RunDir, screenshots: Path
) -> None:
    assert page.locator("tr[data-rollout-id]").count() == 4 + len(run_dir.extra)
    shot(page, screenshots, "rollouts")
    page.goto(f"{server}/rollouts?per_page=3")
    first = page.locator("tr[data-rollout-id]").evaluate_all("rows => rows.map(r => r.dataset.rolloutId)")
    page.click("a[rel=next]")
    second = page.locator("tr[data-rollout-id]").evaluate_all("rows => rows.map(r => r.dataset.rolloutId)")
    assert len(first) == 3 and second and not set(first) & set(second)
    page.goto(f"{server}/rollouts?status=rejected")
    rejected = page.locator("tr[data-rollout-id]").evaluate_all("rows => rows.map(r => r.dataset.rolloutId)")
    assert set(rejected) >= {run_dir.extra["ambiguous"], run_dir.extra["corrupt"]}


def test_a_rejected_rollout_shows_its_code_and_culprit(
    page: Page, server: str, run_dir: RunDir, screenshots: Path
) -> None:
    rollout_id = run_dir.extra["corrupt"]
    page.goto(f"{server}/rollouts/{rollout_id}")
    assert page.locator(".rejection").get_attribute("data-code") == "digest_mismatch"
    assert "FinalizerFailure" in page.locator(".rejection").inner_text()
    culprit = run_dir.call_ids[rollout_id]["b"]
    assert page.locator("a.cause-link").all_inner_texts() == [culprit]
    shot(page, screenshots, "rollout-rejected")
    page.goto(f"{server}/rollouts/{run_dir.extra['ambiguous']}")
    assert page.locator(".rejection").get_attribute("data-code") == "ambiguous_terminal"


def test_a_chains_rollout_links_two_samples(
    page: Page, server: str, run_dir: RunDir, screenshots: Path
) -> None:
    page.goto(f"{server}/rollouts/{run_dir.extra['chains']}")
    links = page.locator("a.sample")
    assert links.count() == 2
    shot(page, screenshots, "rollout-chains")
    links.first.click()
    assert page.url.endswith("/tokens")


def test_the_token_view_is_the_sample(page: Page, server: str, run_dir: RunDir, screenshots: Path) -> None:
    labels: set[str] = set()
    for key, record in samples(run_dir).items():
        page.goto(f"{server}/samples/{key}/tokens")
        tokens = page.locator("#tokens [data-token-id]")
        ids = tokens.evaluate_all("els => els.map(e => Number(e.dataset.tokenId))")
        assert ids == record["token_ids"]
        masks = tokens.evaluate_all("els => els.map(e => Number(e.dataset.mask))")
        assert masks == [int(m) for m in record["token_mask"]]
        # Which distribution the logprobs are of: each call's recorded options, said once.
        shown = page.locator(".sampling [data-sampling]").evaluate_all(
            "els => els.map(e => e.dataset.sampling)"
        )
        assert set(shown) == {sampling_label(span.get("sampling")) for span in record["spans"]}, shown
        labels.update(shown)
    # The run's samples were drawn truncated; the scenarios' calls recorded no options.
    assert {"temperature 0.7, top_p 0.8, top_k 20", sampling_label(None)} <= labels, labels
    key, record = next((k, r) for k, r in samples(run_dir).items() if "@" in k)
    page.goto(f"{server}/samples/{key}/tokens")
    prompt = page.locator("#tokens [data-mask='0']").first
    generated_index = record["token_mask"].index(1.0)
    generated = page.locator("#tokens [data-token-id]").nth(generated_index)
    style = "e => getComputedStyle(e).backgroundColor + getComputedStyle(e).fontStyle"
    assert prompt.evaluate(style) != generated.evaluate(style)
    generated.hover()
    assert (
        json.loads(page.locator("#tip").get_attribute("data-logprob") or "")
        == record["logprobs"][generated_index]
    )
    assert f"id {record['token_ids'][generated_index]}" in page.locator("#tip").inner_text()
    run_key = next(k for k in samples(run_dir) if "@" not in k)
    page.goto(f"{server}/samples/{run_key}/tokens")
    page.locator("#tokens [data-mask='1']").nth(3).hover()
    shot(page, screenshots, "tokens")


def test_a_range_of_tokens_is_copied_as_ids_or_text(page: Page, server: str, run_dir: RunDir) -> None:
    key, record = max(samples(run_dir).items(), key=lambda item: len(item[1]["token_ids"]))
    assert len(record["token_ids"]) >= 16
    page.goto(f"{server}/samples/{key}/tokens")
    tokens = page.locator("#tokens [data-token-id]")
    page.evaluate(
        """() => {
            const els = document.querySelectorAll("#tokens [data-token-id]");
            const range = document.createRange();
            range.setStartBefore(els[2]);
            range.setEndAfter(els[13]);
            getSelection().removeAllRanges();
            getSelection().addRange(range);
        }"""
    )
    page.get_by_role("button", name="copy ids").click()
    status = page.locator("#copy-status")
    expected = ",".join(map(str, record["token_ids"][2:14]))
    expect(status).to_have_text("copied 12 ids")  # the clipboard answers asynchronously
    assert status.get_attribute("data-copied") == expected
    assert page.evaluate("navigator.clipboard.readText()") == expected
    tokens.nth(4).click()
    tokens.nth(0).click(modifiers=["Shift"])
    page.get_by_role("button", name="copy text").click()
    pieces = tokens.evaluate_all("els => els.slice(0, 5).map(e => e.textContent).join('')")
    expect(status).to_have_text("copied the text of 5 tokens")
    assert status.get_attribute("data-copied") == pieces
    assert page.evaluate("navigator.clipboard.readText()") == pieces
    page.evaluate("Object.defineProperty(Navigator.prototype, 'clipboard', {get: () => undefined})")
    page.get_by_role("button", name="copy ids").click()  # as over plain http: the textarea fallback
    expect(status).to_have_text("copied 5 ids")
    reader = page.context.new_page()
    reader.goto(f"{server}/health")
    assert reader.evaluate("navigator.clipboard.readText()") == ",".join(map(str, record["token_ids"][:5]))


def test_groups_and_the_pipeline_page(page: Page, server: str, run_dir: RunDir, screenshots: Path) -> None:
    group = next(str(r["group_id"]) for r in samples(run_dir).values() if "@" not in str(r.get("sample_key")))
    page.goto(f"{server}/groups/{group}")
    assert page.locator("table.group tbody tr").count() == 2
    members = [r for r in samples(run_dir).values() if r["group_id"] == group]
    expected = [f"{a:+.4f}" for a in group_advantages([r["reward"] for r in members])]
    shown = [text for text in page.locator("td.advantage").all_inner_texts() if text != "-"]
    assert sorted(shown) == sorted(expected)  # rejected members, absent from the archive, show none
    shot(page, screenshots, "group")
    page.goto(f"{server}/pipeline")
    text = page.locator("main").inner_text()
    assert "digest_mismatch" in text and "ledger: 0" in text
    bars = page.locator("svg.timeline g[data-finalized]")
    finalized = bars.evaluate_all("gs => gs.reduce((n, g) => n + Number(g.dataset.finalized), 0)")
    assert finalized == 4 + len(run_dir.extra)  # every rollout of the run, each in one bucket
    codes = set(page.locator("table.timeline th code").all_text_contents())
    assert {"digest_mismatch", "ambiguous_terminal"} <= codes
    shot(page, screenshots, "pipeline")


def test_a_train_step_s_report_and_its_worst_tokens_beside_the_behaviour(
    page: Page, server: str, run_dir: RunDir, screenshots: Path
) -> None:
    """The step the run recorded: its report (on policy, so ~0), its worst tokens linking to
    the token view, which then shows the trainer's logprob beside the behaviour's and shades
    each generated token by their difference."""
    page.goto(f"{server}/steps")
    rows = page.locator("table.steps tbody tr")
    expect(rows).to_have_count(1)
    assert float(rows.first.locator("td.dev").inner_text()) <= 1e-4
    rows.first.locator("a").first.click()
    assert float(page.locator("[data-metric='max_abs_dev']").inner_text()) <= 1e-4
    expect(page.locator("table.buckets")).to_contain_text("lag 0")
    shot(page, screenshots, "step")
    worst = page.locator("table.worst tbody tr").first
    position = int(worst.locator("td").nth(4).inner_text())
    worst.locator("a").click()
    assert "step=" in page.url
    expect(page.locator(".legend.diff")).to_be_visible()
    generated = page.locator("#tokens [data-mask='1']")
    classes = generated.evaluate_all("els => els.map(e => e.className)")
    assert classes and all(" d" in c and " v" not in c for c in classes), classes[:5]
    token = page.locator(f"#p{position}")
    token.hover()
    tip = page.locator("#tip").inner_text()
    assert "trainer" in tip and "Δ" in tip
    behaviour, trainer = (
        float(token.get_attribute(name) or "") for name in ("data-logprob", "data-trainer-logprob")
    )
    assert abs(trainer - behaviour) <= 1e-4  # on policy: the replayed distribution is the sampled one
    shot(page, screenshots, "tokens-step")
    page.goto(page.url.split("?")[0])  # without a step: shaded by probability again
    expect(page.locator(".legend.diff")).to_have_count(0)
    expect(page.locator(".steps-of a").first).to_be_visible()


def chart_points(page: Page, chart: str, series: str) -> list[tuple[int, float]]:
    """(step, value) of every point the browser drew in one series of one chart."""
    points = page.locator(f"figure[data-chart='{chart}'] g.series[data-series='{series}'] circle")
    return [
        (int(step), float(value))
        for step, value in points.evaluate_all("cs => cs.map(c => [c.dataset.step, c.dataset.value])")
    ]


def test_the_steps_page_charts_the_recorded_step(page: Page, server: str, run_dir: RunDir) -> None:
    """The run's one step: one point per series, at the values its step file holds."""
    (record,) = [json.loads(path.read_text()) for path in (run_dir.path / "steps").glob("*.json")]
    page.goto(f"{server}/steps")
    for chart in ("reward", "k3", "ratio_max"):
        expect(page.locator(f"figure[data-chart='{chart}'] svg")).to_be_visible()
    assert chart_points(page, "reward", "mean reward") == [(1, pytest.approx(record["reward_mean"]))]
    report = record["mismatch"]
    assert chart_points(page, "k3", "all tokens") == [(1, pytest.approx(report["k3"]))]
    assert chart_points(page, "ratio_max", "all tokens") == [(1, pytest.approx(report["ratio_max"]))]
    for lag, bucket in report["buckets"]["lag"].items():
        assert chart_points(page, "ratio_max", f"lag {lag}") == [(1, pytest.approx(bucket["ratio_max"]))]
    tip = page.locator("figure[data-chart='reward'] circle title").first.text_content() or ""
    assert tip.startswith("mean reward, step 1: ")


@pytest.fixture(scope="module")
def many_steps(run_dir: RunDir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's archive and credentials with six steps made from its one step's record:
    rewards rising (step 3's missing), k3 and the largest ratio growing, a lag 1 bucket from step 4."""
    data_dir = tmp_path_factory.mktemp("many-steps") / "tt"
    (data_dir / "steps").mkdir(parents=True)
    shutil.copy(archive_path(run_dir.path), archive_path(data_dir))
    shutil.copytree(run_dir.path / "credentials", data_dir / "credentials")
    (source,) = (run_dir.path / "steps").glob("*.json")
    record = json.loads(source.read_text())
    for step in range(1, 7):
        report = json.loads(json.dumps(record["mismatch"]))
        report["k3"] = 10.0 ** (step - 10)
        report["ratio_max"] = 1.0 + step / 4
        if step >= 4:
            report["buckets"]["lag"]["1"] = {**report["buckets"]["lag"]["0"], "ratio_max": 2.0 + step / 4}
        written = {
            **record,
            "step": step,
            "reward_mean": None if step == 3 else step / 10,
            "mismatch": report,
        }
        (data_dir / "steps" / f"{record['run_id']}-step-{step}.json").write_text(json.dumps(written))
    return data_dir


def test_many_steps_chart_a_point_per_step_with_gaps_where_a_value_is_missing(
    browser: Browser,
    many_steps: Path,
    run_dir: RunDir,
    tmp_path_factory: pytest.TempPathFactory,
    screenshots: Path,
) -> None:
    with inspecting(many_steps, tmp_path_factory) as server, logged_in(browser, server, run_dir) as page:
        page.goto(f"{server}/steps")
        assert chart_points(page, "reward", "mean reward") == [
            (step, pytest.approx(step / 10)) for step in (1, 2, 4, 5, 6)
        ]
        reward = page.locator("figure[data-chart='reward'] polyline")
        expect(reward).to_have_count(2)  # steps 1-2, then 4-6: no line across the missing step
        assert chart_points(page, "k3", "all tokens") == [
            (step, pytest.approx(10.0 ** (step - 10))) for step in range(1, 7)
        ]
        assert [step for step, _ in chart_points(page, "ratio_max", "lag 1")] == [4, 5, 6]
        ticks = page.locator("figure[data-chart='k3'] text.x-tick").all_text_contents()
        assert ticks == [str(step) for step in range(1, 7)]
        legend = page.locator("figure[data-chart='ratio_max'] .series-name").all_text_contents()
        assert legend == ["all tokens", "lag 0", "lag 1"]
        heights = [
            float(
                page.locator(f"figure[data-chart='k3'] circle[data-step='{s}']").first.get_attribute("cy")
                or ""
            )
            for s in (1, 6)
        ]
        assert heights[0] > heights[1]  # the larger k3 is drawn higher
        shot(page, screenshots, "steps-charts")


def test_unknown_ids_give_404_pages(
    browser: Browser, server: str, run_dir: RunDir, screenshots: Path
) -> None:
    """Its own context: the browser logs each 404 document as a console error, rightly here."""
    context = browser.new_context()
    page = context.new_page()
    token = (run_dir.path / "credentials" / "operator.token").read_text().strip()
    page.goto(f"{server}/rollouts?token={token}")
    for path, what in (
        ("/rollouts/no-such-rollout", "no-such-rollout"),
        ("/samples/no-such@key/tokens", "no-such@key"),
        ("/steps/no-such-step", "no-such-step"),
    ):
        reply = page.goto(server + path)
        assert reply is not None and reply.status == 404
        assert what in page.locator(".missing").inner_text()
    shot(page, screenshots, "missing")
    context.close()
