"""The mismatch report: exact values on constructed batches, buckets, worst tokens, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from stages.trainer.mismatch import Bounds, Tokens, report
from topics import digest
from topics.records import TrainingSample


def sample(key: str, n: int, calls: int = 1) -> TrainingSample:
    """``n`` tokens: one prompt token, then ``calls`` calls of ``(n - 1) // calls`` generated tokens."""
    ids = list(range(10, 10 + n))
    each = (n - 1) // calls
    spans = [
        {"call_id": f"c{i + 1}", "start": 1 + i * each - (i == 0), "carry_len": int(i == 0), "gen_len": each}
        for i in range(calls)
    ]
    return TrainingSample.model_validate(
        {
            "rollout_id": key,
            "token_ids": ids,
            "token_mask": [0.0] + [1.0] * (n - 1),
            "logprobs": [0.0] + [-1.0] * (n - 1),
            "weight_versions": [0] * n,
            "spans": spans,
            "cumulative_hash": digest.cumulative_hash(ids),
        }
    )


def tokens(
    delta: list[float],
    *,
    sample: list[int] | None = None,
    version: list[int] | None = None,
    turn: list[int] | None = None,
    straddled: list[bool] | None = None,
) -> Tokens:
    n = len(delta)
    rows = sample or [0] * n
    behaviour = torch.full((n,), -1.0, dtype=torch.float64)
    return Tokens(
        behaviour=behaviour,
        trainer=behaviour + torch.tensor(delta, dtype=torch.float64),
        sample=torch.tensor(rows, dtype=torch.int64),
        position=torch.tensor([1 + rows[:i].count(row) for i, row in enumerate(rows)], dtype=torch.int64),
        version=torch.tensor(version or [0] * n, dtype=torch.int64),
        turn=torch.tensor(turn or [0] * n, dtype=torch.int64),
        straddled=torch.tensor(straddled or [False] * n, dtype=torch.bool),
        after_tool=torch.zeros(n, dtype=torch.bool),
        log_kept=torch.zeros(n),
        rank=torch.ones(n, dtype=torch.int64),
    )


def test_on_policy_every_metric_is_zero() -> None:
    result = report(
        tokens([0.0] * 6, sample=[0, 0, 0, 1, 1, 1]), [sample("a", 4), sample("b", 4)], policy_version=0
    )
    for name in ("k1", "k3", "chi2_token", "chi2_sequence", "log_ppl_diff", "max_abs_dev"):
        assert result[name] == pytest.approx(0.0, abs=1e-12), name
    assert result["ess_token"] == pytest.approx(1.0) and result["ess_sequence"] == pytest.approx(1.0)
    for level in ("token", "sequence", "geometric"):
        assert result["corrections"][level] == {"tis_clipped_fraction": 0.0, "mis_masked_fraction": 0.0}


def test_a_constant_shift_gives_the_closed_forms() -> None:
    c = 0.1
    result = report(tokens([c] * 4, sample=[0, 0, 1, 1]), [sample("a", 3), sample("b", 3)], policy_version=0)
    assert result["k1"] == pytest.approx(-c)
    assert result["k3"] == pytest.approx(math.exp(c) - 1 - c)
    assert result["chi2_token"] == pytest.approx(math.exp(2 * c) - 1)
    assert result["chi2_sequence"] == pytest.approx(math.exp(4 * c) - 1)  # two tokens a sequence
    assert result["log_ppl_diff"] == pytest.approx(-c)
    assert result["ratio_min"] == pytest.approx(math.exp(c)) == result["ratio_max"]
    assert result["max_abs_dev"] == pytest.approx(math.exp(c) - 1)


def test_corrections_count_what_they_clip_and_mask() -> None:
    delta = [math.log(3.0), math.log(0.4), 0.0, 0.0]  # one above both caps, one below the low bound
    result = report(tokens(delta, sample=[0, 0, 1, 1]), [sample("a", 3), sample("b", 3)], policy_version=0)
    token = result["corrections"]["token"]
    assert token["tis_clipped_fraction"] == 0.25 and token["mis_masked_fraction"] == 0.5
    sequence = result["corrections"]["sequence"]  # sequence 0's ratio is 1.2: inside the bounds
    assert sequence == {"tis_clipped_fraction": 0.0, "mis_masked_fraction": 0.0}
    assert result["ess_token"] < 1


def test_buckets_split_by_provenance_and_the_worst_tokens_are_named() -> None:
    delta = [0.0, 0.0, 0.5, -0.9, 0.2, 0.0]
    result = report(
        tokens(
            delta, version=[2, 2, 1, 0, 0, 2], turn=[0, 0, 1, 1, 2, 2], straddled=[False] * 4 + [True] * 2
        ),
        [sample("a", 7, calls=3)],
        policy_version=2,
        bounds=Bounds(worst=2),
    )
    lag = result["buckets"]["lag"]
    assert sorted(lag) == ["0", "1", "2"]
    assert lag["0"]["tokens"] == 3 and lag["0"]["max_abs_log_ratio"] == 0.0
    assert lag["2"]["max_abs_log_ratio"] == pytest.approx(0.9)
    assert result["buckets"]["turn"]["1"]["tokens"] == 2
    assert result["buckets"]["straddled"]["tokens"] == 2 and result["buckets"]["clean"]["tokens"] == 4
    assert result["buckets"]["after_tool"] == {
        "tokens": 0,
        **{k: None for k in result["buckets"]["after_tool"] if k != "tokens"},
    }
    worst = result["worst"]
    assert [w["delta"] for w in worst] == pytest.approx([-0.9, 0.5])
    assert worst[0] | {"delta": 0} == {
        "sample_key": "a",
        "call_id": "c2",
        "turn": 1,
        "position": 4,
        "token_id": 14,
        "weight_version": 0,
        "lag": 2,
        "behaviour_logprob": -1.0,
        "trainer_logprob": pytest.approx(-1.9),
        "delta": 0,
        "rank": 1,
        "log_kept": 0.0,
        "straddled": False,
    }


def test_an_empty_batch_reports_no_values() -> None:
    result = report(tokens([]), [], policy_version=0)
    assert result["tokens"] == 0 and result["k1"] is None and result["worst"] == []


def test_tensors_of_another_shape_are_refused_by_name() -> None:
    good = tokens([0.0, 0.0])
    with pytest.raises(ValueError, match="turn: shape"):
        Tokens(**{**{name: getattr(good, name) for name in Tokens.__slots__}, "turn": torch.zeros(3)})


@pytest.mark.parametrize(
    ("fields", "name"),
    [({"mis_low": 0.0}, "mis_low"), ({"tis_cap": 0.5}, "tis_cap"), ({"worst": -1}, "worst")],
)
def test_bounds_out_of_range_are_refused_by_name(fields: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Bounds(**fields)  # type: ignore[arg-type]
