"""The gateway's bookmark on the real broker: a restart reads from it, a replica takes over.

The events are what a gateway and a worker publish (``bench.gateway_recovery``): no engine
is needed to check which offsets are committed and which sessions come back.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition

from bench.gateway_recovery import gateway_rollouts, publish
from pipeline.gateway.bookmark import Bookmark, group_of
from pipeline.gateway.recovery import recover, still_ours, take_over
from pipeline.gateway.sessions import SessionError, Sessions
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.keys import partition_of
from pipeline.kafka.lag import LagReader
from stages.client import RolloutClient
from stages.memory import RecordingSink
from topics.records import CaptureAdmission

pytestmark = [pytest.mark.broker]

CALLS = 3


def sessions() -> Sessions:
    return Sessions(RolloutClient(RecordingSink()), ttl_s=600.0)


async def committed(
    kafka: KafkaConfig, group: str, tps: list[TopicPartition]
) -> dict[TopicPartition, int | None]:
    async with LagReader(kafka) as reader:
        return await reader.committed(group, tps)


def test_a_restart_reads_from_the_bookmark_and_reopens_only_open_sessions(kafka_config: KafkaConfig) -> None:
    async def go() -> None:
        await ensure_topics(kafka_config)
        await publish(kafka_config, gateway_rollouts("done", 20, CALLS, sealed=True))
        live = sessions()
        bookmark = Bookmark(kafka_config, live, replica=None, max_open_s=3600.0)
        assert all(offset == 0 for offset in (await bookmark.start()).values())
        ends = await bookmark.advance()  # nothing open: the log's end
        assert await committed(kafka_config, "tokentrail-gateway", sorted(ends)) == ends
        live.open("open0", "g")  # its floor: the watermarks read last
        floor = dict(live.get("open0").floor)
        await publish(kafka_config, gateway_rollouts("open", 1, CALLS, sealed=False))
        await publish(kafka_config, gateway_rollouts("later", 20, CALLS, sealed=True))
        point = await bookmark.advance()
        partition = partition_of("open0", kafka_config.names.partitions)
        for tp, offset in point.items():  # held back where the open session lies, alone
            assert offset == floor[tp] if tp.partition == partition else offset >= floor[tp], (tp, point)
        assert sum(point.values()) > sum(floor.values())

        restarted = sessions()
        start = await Bookmark(kafka_config, restarted, replica=None, max_open_s=3600.0).start()
        assert start == point
        assert await recover(kafka_config, restarted, start=start, max_open_s=3600.0) == 1
        assert [c.call_id for c in restarted.get("open0").calls] == [f"c{i}" for i in range(CALLS)]
        assert restarted.get("open0").group_id == "g" and restarted.get("open0").floor == start

    asyncio.run(go())


def test_a_restart_leaves_rollouts_older_than_max_open_closed(kafka_config: KafkaConfig) -> None:
    async def go() -> None:
        await ensure_topics(kafka_config)
        old = [
            event.model_copy(update={"admitted_at": time.time() - 7200})
            if isinstance(event, CaptureAdmission)
            else event
            for chunk in gateway_rollouts("old", 2, CALLS, sealed=False)
            for event in chunk
        ]
        await publish(kafka_config, iter([old]))
        await publish(kafka_config, gateway_rollouts("new", 1, CALLS, sealed=False))
        restarted = sessions()
        assert await recover(kafka_config, restarted, max_open_s=3600.0) == 1
        assert restarted.open_count == 1 and restarted.get("new0").calls

    asyncio.run(go())


def test_a_replica_takes_over_open_rollouts_and_knows_sealed_ones(kafka_config: KafkaConfig) -> None:
    async def go() -> None:
        await ensure_topics(kafka_config)
        first = sessions()
        first_mark = Bookmark(kafka_config, first, replica="a", max_open_s=3600.0)
        await first_mark.start()
        await first_mark.advance()
        await publish(kafka_config, gateway_rollouts("done", 2, CALLS, sealed=True))
        await publish(kafka_config, gateway_rollouts("open", 2, CALLS, sealed=False))

        second = sessions()
        bookmark = Bookmark(kafka_config, second, replica="b", max_open_s=3600.0)
        await bookmark.start()
        bookmark.inherit()
        assert bookmark.inherited == {}  # a new replica holds nothing back

        async def take(rollout_id: str) -> None:
            await take_over(kafka_config, second, bookmark, rollout_id)

        second.take_over = take
        held = await asyncio.gather(second.held("open1"), second.held("open1"))
        assert held[0] is held[1] and len(held[0].calls) == CALLS and second.taken_over == 1
        assert held[0].group_id == "g"
        for rollout_id, status in (("done1", 409), ("never-opened", 404)):
            with pytest.raises(SessionError) as caught:
                await second.held(rollout_id)
            assert caught.value.status == status, rollout_id
        opened = await second.held("opened-elsewhere", ("g2", "render"))  # nothing on the log
        assert (opened.group_id, opened.history, second.taken_over) == ("g2", "render", 2)
        # an idle session is sealed abandoned only while no other replica has gone on with it
        assert await still_ours(kafka_config, bookmark, held[0])
        elsewhere = CaptureAdmission(
            rollout_id="open1",
            call_id="c-elsewhere",
            mode="text",
            prev_len=0,
            logical_call_id="ht9-" + "0" * 32,
            admitted_at=time.time(),
        )
        await publish(kafka_config, iter([[elsewhere]]))
        assert not await still_ours(kafka_config, bookmark, held[0])
        # the replica's own bookmark now covers the session it took over
        ours = await committed(kafka_config, group_of("b"), sorted(held[0].floor))
        assert all(ours[tp] is not None and ours[tp] <= offset for tp, offset in held[0].floor.items())

    asyncio.run(go())
