"""Call trees played through the real capture core: trees, retries, rewritten histories and
a corrupted row, each sealed under a sample policy. Used by the sample-policy tests and the
inspector's run (a rejected and a multi-sample rollout beside a real run's)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pipeline.dataplane import encoding as rows_codec
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.producer import KafkaEventSink
from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from topics.records import CommitCoords, SamplePolicy, StagedCall


@dataclass(frozen=True, slots=True)
class Node:
    """One call: ``prompt`` is what the agent adds before it, ``gen`` what the engine adds."""

    name: str
    parent: str | None
    prompt: tuple[int, ...]
    gen: tuple[int, ...]
    logical: str | None = None
    served: bool = True


@dataclass(frozen=True, slots=True)
class Scenario:
    nodes: tuple[Node, ...]
    policy: SamplePolicy
    all_or_nothing: bool | None = None
    corrupt: str | None = None
    """A node whose row is overwritten with a flipped token after capture."""
    call_rewards: tuple[tuple[str, float], ...] = ()
    """Per-call rewards the seal gives, by node name."""


# root -> a -> a2, root -> b, root -> c -> c2: three surviving leaves (a2, b, c2).
TREE = (
    Node("root", None, (100, 101), (1, 2)),
    Node("a", "root", (110,), (3, 4)),
    Node("a2", "a", (111,), (5,)),
    Node("b", "root", (120,), (6, 7)),
    Node("c", "root", (130,), (8,)),
    Node("c2", "c", (131,), (9, 10)),
)
# Three turns, an abandoned retry of turn 2, then the agent compacts its history at
# turn 4: a new root, continued for two more turns.
REWRITTEN = (
    Node("t1", None, (100, 101), (1,)),
    Node("t2-retry", "t1", (102,), (77,)),
    Node("t2", "t1", (102,), (2,)),
    Node("t3", "t2", (103,), (3, 3)),
    Node("t4", None, (200, 201), (4,)),
    Node("t5", "t4", (202,), (5,)),
    Node("t6", "t5", (203,), (6, 6)),
)
# Turn 2 sent twice under one logical id (both served, the first dropped by the agent),
# turn 3 failed once and was retried; beside them one real branch (b).
RETRIED = (
    Node("root", None, (100, 101), (1,)),
    Node("t2-first", "root", (102,), (21,), logical="turn-2"),
    Node("t2", "root", (102,), (2,), logical="turn-2"),
    Node("t3-failed", "t2", (103,), (99,), served=False),
    Node("t3", "t2", (103,), (3,)),
    Node("b", "root", (120,), (6,)),
)
SCENARIOS = {
    "tree-terminal": Scenario(TREE, "terminal"),
    "tree-leaves": Scenario(TREE, "leaves"),
    # Process rewards for turn 3 and turn 6, and for the abandoned retry (on no sample).
    "rewritten-chains": Scenario(
        REWRITTEN, "chains", call_rewards=(("t3", 0.3), ("t6", 0.6), ("t2-retry", 0.9))
    ),
    "retried-leaves": Scenario(RETRIED, "leaves"),
    "corrupt-leaves": Scenario(TREE, "leaves", corrupt="b"),
    "corrupt-all-or-nothing": Scenario(TREE, "leaves", all_or_nothing=True, corrupt="b"),
}


def chain_tokens(nodes: tuple[Node, ...], leaf: str) -> tuple[list[int], list[float], list[float]]:
    """The ids, mask and logprobs a sample ending at ``leaf`` must have."""
    by_name = {node.name: node for node in nodes}
    chain: list[Node] = []
    current: str | None = leaf
    while current is not None:
        chain.append(by_name[current])
        current = by_name[current].parent
    ids: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    for node in reversed(chain):
        ids += [*node.prompt, *node.gen]
        mask += [0.0] * len(node.prompt) + [1.0] * len(node.gen)
        logprobs += [0.0] * len(node.prompt) + [-0.5] * len(node.gen)
    return ids, mask, logprobs


@contextlib.asynccontextmanager
async def capturing(
    plane: TransferQueueDataPlane, sink: KafkaEventSink, worker_id: str
) -> AsyncIterator[tuple[CaptureCore, RolloutClient]]:
    """A worker's capture core over the real data plane and broker; its writer drained on exit."""
    cache = ChainCache()
    writer = StagingWriter(plane, sink, worker_id=worker_id, batch_delay_s=0.002)
    writer.start()
    try:
        yield (
            CaptureCore(PrefixResolver(plane, cache, wait_s=5.0), writer, cache, ack_policy=AckPolicy.STAGED),
            RolloutClient(sink),
        )
    finally:
        await writer.stop()


async def capture(
    core: CaptureCore,
    client: RolloutClient,
    plane: TransferQueueDataPlane,
    rollout_id: str,
    scenario: Scenario,
) -> dict[str, str]:
    coords: dict[str, CommitCoords] = {}
    seen: dict[str, list[int]] = {}
    call_ids: dict[str, str] = {}
    for node in scenario.nodes:
        parent = coords.get(node.parent) if node.parent else None
        admission = client.admit(rollout_id, parent, group_id="g", logical_call_id=node.logical)
        await client.publish_admission(admission)
        call_ids[node.name] = admission.call_id
        prepared = await core.prepare(admission)
        if not node.served:
            await core.refuse(admission, weight_version=0).final_coords()
            continue
        prompt = [*(seen[node.parent] if node.parent else []), *node.prompt]
        done = core.complete(prepared, prompt, list(node.gen), [-0.5] * len(node.gen), weight_version=0)
        coords[node.name] = await done.final_coords()
        seen[node.name] = [*prompt, *node.gen]
    if scenario.corrupt is not None:
        key = coords[scenario.corrupt].staging_key
        row = (await plane.get_calls([key]))[key]
        flipped = StagedCall.model_construct(
            **{**row.model_dump(), "token_ids_delta": [*row.token_ids_delta[:-1], 999]}
        )
        await plane.delete_calls([key])
        await plane.put_rows("staging", [key], rows_codec.encode_calls([flipped]), rows_codec.CALL_LAYOUTS[0])
    await client.seal(
        rollout_id,
        group_id="g",
        reward=1.0,
        sample_policy=scenario.policy,
        all_or_nothing=scenario.all_or_nothing,
        call_rewards={call_ids[name]: reward for name, reward in scenario.call_rewards},
    )
    return call_ids
