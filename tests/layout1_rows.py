"""Rows as releases before row layout 2 wrote them (layout 1: one typed field per vector).

The writer lives here, beside the tests, because no tokentrail process writes layout 1
any more; readers still must read it (a data plane can outlive an upgrade).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from pipeline.dataplane import documents
from topics.records import StagedCall, TrainingSample


def _stack(rows: list[torch.Tensor]) -> NonTensorStack:
    return NonTensorStack(*rows)


def _bytes(blob: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def encode_calls(rows: Sequence[StagedCall]) -> TensorDict:
    return TensorDict(
        {
            "token_ids": _stack([torch.tensor(r.token_ids_delta, dtype=torch.int64) for r in rows]),
            "token_mask": _stack([torch.tensor(r.token_mask_delta, dtype=torch.float32) for r in rows]),
            "logprobs": _stack([torch.tensor(r.logprobs_delta, dtype=torch.float32) for r in rows]),
            "counts": torch.tensor(
                [[r.prev_len, r.delta_len, r.cum_len, r.weight_version] for r in rows], dtype=torch.int64
            ),
            "meta": _stack([_bytes(documents.call_meta(r)) for r in rows]),
        },
        batch_size=[len(rows)],
    )


def encode_samples(samples: Sequence[TrainingSample]) -> TensorDict:
    return TensorDict(
        {
            "token_ids": _stack([torch.tensor(s.token_ids, dtype=torch.int64) for s in samples]),
            "token_mask": _stack([torch.from_numpy(np.asarray(s.token_mask, np.float32)) for s in samples]),
            "logprobs": _stack([torch.from_numpy(np.asarray(s.logprobs, np.float32)) for s in samples]),
            "weight_versions": _stack([torch.tensor(s.weight_versions, dtype=torch.int64) for s in samples]),
            "meta": _stack([_bytes(documents.sample_meta(s)) for s in samples]),
        },
        batch_size=[len(samples)],
    )
