"""The token view's HTML for archive records built as the run archives them."""

from __future__ import annotations

import re
from typing import Any

from pipeline.inspect.tokens import render_tokens
from pipeline.samples.archive import sample_record
from topics import digest
from topics.records import TrainingSample


def record(versions: list[int]) -> dict[str, Any]:
    """Two calls of 2 prompt + 3 generated tokens each, with these per-token weight versions."""
    ids = list(range(100, 110))
    sample = TrainingSample.model_validate(
        {
            "rollout_id": "run-20250101-000000-abcdef.t0.0",
            "group_id": "run-20250101-000000-abcdef.t0",
            "token_ids": ids,
            "token_mask": [0.0, 0.0, 1.0, 1.0, 1.0] * 2,
            "logprobs": [0.0, 0.0, -0.1, -0.2, -0.3] * 2,
            "weight_versions": versions,
            "spans": [
                {"call_id": "c1", "start": 0, "carry_len": 2, "gen_len": 3},
                {"call_id": "c2", "start": 5, "carry_len": 2, "gen_len": 3},
            ],
            "reward": 1.0,
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )
    return sample_record(sample, "run-20250101-000000-abcdef")


def refits(html: str) -> list[tuple[str, str]]:
    """(token id, title) of every token marked as a refit straddle."""
    return re.findall(r'<span class="[^"]*\brefit\b[^"]*" title="([^"]*)"[^>]*data-token-id="(\d+)"', html)


def test_a_version_change_inside_a_call_is_marked_where_it_changes() -> None:
    view = render_tokens(record([0, 0, 0, 1, 1, 1, 1, 1, 2, 2]), None)
    assert view.straddles == 2
    assert refits(view.html) == [("weight version 0 → 1", "103"), ("weight version 1 → 2", "108")]


def test_a_change_at_a_call_boundary_is_no_straddle() -> None:
    view = render_tokens(record([0, 0, 0, 0, 0, 1, 1, 1, 1, 1]), None)
    assert view.straddles == 0 and "refit" not in view.html
    assert view.html.count("data-token-id=") == 10
