"""A rebuild never skips what retention deleted: it stops, naming the lost offsets."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from pipeline.replay.rebuild import LogGone, require_retained

A0, A1 = TopicPartition("t.admission", 0), TopicPartition("t.admission", 1)


def test_a_log_that_still_holds_the_start_is_read() -> None:
    require_retained({A0: None, A1: 40}, {A0: 0, A1: 40})


def test_deleted_events_stop_the_rebuild_naming_them() -> None:
    with pytest.raises(LogGone) as raised:
        require_retained({A0: None, A1: 40}, {A0: 100, A1: 55})
    message = str(raised.value)
    assert "t.admission:0 offsets 0..99" in message and "t.admission:1 offsets 40..54" in message
    assert "--checkpoints" in message
