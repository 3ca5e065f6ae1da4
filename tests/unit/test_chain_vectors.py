"""A chain's vectors checked as one array per field give each row what checking it
alone gives: its mask results, its sign and finiteness, its canonical bytes."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from stages.finalize.vectors import ChainVectors
from topics import canonical
from topics.records import StagedCall

MASK_VALUES = st.sampled_from([0.0, 1.0, 0.5, -1.0, math.nan])
LOGPROBS = st.one_of(st.floats(-30.0, 0.0), st.sampled_from([math.inf, -math.inf, math.nan]))


@st.composite
def rows(draw: st.DrawFn) -> list[StagedCall]:
    """Rows of random lengths (empty ones too) with ordered, stray or non-finite values."""
    found = []
    for _ in range(draw(st.integers(1, 5))):
        length = draw(st.integers(0, 6))
        carry = draw(st.integers(0, length))
        mask = [0.0] * carry + [1.0] * (length - carry)
        if length and draw(st.booleans()):
            mask[draw(st.integers(0, length - 1))] = draw(MASK_VALUES)
        found.append(
            StagedCall.model_construct(
                token_ids_delta=draw(st.lists(st.integers(-3, 2**40), min_size=length, max_size=length)),
                token_mask_delta=mask,
                logprobs_delta=draw(st.lists(LOGPROBS, min_size=length, max_size=length)),
            )
        )
    return found


@given(rows())
def test_each_row_reads_what_checking_it_alone_gives(chain: list[StagedCall]) -> None:
    vectors = ChainVectors.of(chain)
    for index, row in enumerate(chain):
        mask = np.asarray(row.token_mask_delta, dtype=np.float64)
        ids = np.asarray(row.token_ids_delta, dtype=np.int64)
        logprobs = np.asarray(row.logprobs_delta, dtype=np.float64)
        ones = mask == 1.0
        carry = mask.size - int(ones.sum())
        assert vectors.stray_mask[index] == int((~(ones | (mask == 0.0))).sum())
        assert vectors.generated[index] == int(ones.sum()) and vectors.carry(index) == carry
        assert vectors.out_of_order[index] == int((ones != (np.arange(mask.size) >= carry)).sum())
        assert vectors.negative_ids[index] == int((ids < 0).sum())
        finite = np.isfinite(mask) & np.isfinite(logprobs)
        assert vectors.not_finite[index] == int((~finite).sum())
        where = vectors.span(index)
        assert vectors.ids[where].tolist() == row.token_ids_delta
        if not vectors.negative_ids[index]:
            assert vectors.ids_canonical[where].tobytes() == canonical.ids_array(ids).tobytes()
        if finite.all():
            assert vectors.mask_canonical[where].tobytes() == canonical.f32s_parts(mask)[1].tobytes()
            assert vectors.logprobs_canonical[where].tobytes() == canonical.f32s_parts(logprobs)[1].tobytes()
