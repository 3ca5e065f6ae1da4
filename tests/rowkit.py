"""Small valid rows for tests that need something in the staging partition."""

from __future__ import annotations

from topics import digest
from topics.records import StagedCall
from topics.staging import staging_row


def text_row(rollout_id: str, call_id: str) -> StagedCall:
    """A digested root row of three tokens (two prompt, one generated)."""
    return staging_row(
        rollout_id=rollout_id,
        call_id=call_id,
        parent_call_id=None,
        parent_chain_hash=None,
        prefix_ids=[],
        delta=digest.build_delta([1, 2], [3], [-0.5], 0),
        weight_version=0,
    )
