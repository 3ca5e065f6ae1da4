"""The rollout table over 100,000 rollouts: filter, search, sort and pages on the server."""

from __future__ import annotations

import time

import pytest

from pipeline.inspect.table import RolloutTable, TableQuery
from topics.records import FinalizedEvent

RUN = "run-20250101-000000-abcdef"


def finalized(i: int) -> FinalizedEvent:
    """Every 10th rollout rejected; rewards vary so sorting by them means something."""
    rejected = i % 10 == 0
    return FinalizedEvent(
        rollout_id=f"{RUN}.t{i // 4}.{i % 4}",
        group_id=f"{RUN}.t{i // 4}",
        status="rejected" if rejected else "accepted",
        rejection_reason="digest_mismatch" if rejected else None,
        sample_key=None if rejected else f"{RUN}.t{i // 4}.{i % 4}",
        prompt_len=10,
        total_len=20 + i % 97,
        generated_tokens=10,
        call_count=1 + i % 3,
        min_weight_version=0,
        max_weight_version=i % 2,
        reward=(i * 7919 % 1000) / 1000,
        finalized_at=1.0 + i,
    )


@pytest.fixture(scope="module")
def table() -> RolloutTable:
    events = {e.rollout_id: e for e in map(finalized, range(100_000))}
    return RolloutTable.from_log({}, events)


def test_pages_cover_every_rollout_once(table: RolloutTable) -> None:
    seen: list[str] = []
    page = 1
    while True:
        found = table.page(TableQuery(page=page, per_page=500))
        seen += [row.rollout_id for row in found.rows]
        if page == found.pages:
            break
        page += 1
    assert len(seen) == len(set(seen)) == 100_000
    assert seen == sorted(seen)


def test_filter_search_and_sort(table: RolloutTable) -> None:
    rejected = table.page(TableQuery(status="rejected", per_page=500))
    assert rejected.matching == 10_000 and all(r.failure_code == "digest_mismatch" for r in rejected.rows)
    found = table.page(TableQuery(search=".T123.", per_page=10))
    assert {r.group_id for r in found.rows} == {f"{RUN}.t123"} and found.matching == 4
    top = table.page(TableQuery(sort="reward", descending=True, per_page=5)).rows
    assert [r.reward for r in top] == sorted((r.reward for r in top), reverse=True)
    assert top[0].reward == 0.999
    assert table.page(TableQuery(sort="nonsense", page=-3, per_page=10**6)).query == TableQuery(per_page=500)


def test_a_page_stays_fast_once_sorted(table: RolloutTable) -> None:
    table.page(TableQuery(sort="tokens"))
    started = time.perf_counter()
    for page in range(1, 21):
        table.page(TableQuery(sort="tokens", status="accepted", page=page))
    assert (time.perf_counter() - started) / 20 < 0.25
