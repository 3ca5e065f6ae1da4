"""pydantic-ai rewrites ``<think>`` in any model's reply; no such episode is lost.

pydantic-ai parses ``<think>...</think>`` out of the content of every model's reply, not
only a reasoning family's, and sends the turn back with the opening tag replaced by a
blank line. On the ChatML tiny model, which samples the added token ``<think>`` now and
then, that reply no longer matches what the gateway returned: the next call continues an
earlier one (one root, two leaves) or starts a new root. Under ``terminal`` the gateway's
seal declares the last call as the episode's end in both cases (``lineage.episode_end``),
so every rewarded episode is accepted, its sample being the chain the episode ended in.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from enginekit import HFOracle, assert_matches_hf, assert_sample_is_what_the_engine_saw, start_rig
from familykit import FamilyEngine
from frameworkkit import Tap, chain_ending
from gatewaykit import serve_gateway
from pydantic_ai import Agent, ModelSettings
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

pytestmark = [pytest.mark.slow, pytest.mark.engine]

EPISODES = 20
MAX_TOKENS = 24
QUESTIONS = ("What is 2 + 3?", "And 4 more?", "Explain it step by step.")


def three_turns(opened: dict[str, Any], tap: Tap, seed: int) -> None:
    """pydantic-ai's chat agent, sampled at temperature 1, three questions in one history."""

    async def episode() -> None:
        async with tap.async_client() as http:
            provider = OpenAIProvider(
                base_url=opened["base_url"], api_key=opened["api_key"], http_client=http
            )
            settings = ModelSettings(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
            agent = Agent(OpenAIChatModel("tiny", provider=provider), model_settings=settings)
            history = None
            for question in QUESTIONS:
                result = await agent.run(question, message_history=history)
                history = result.all_messages()

    asyncio.run(episode())


def leaves(calls: list[dict[str, Any]]) -> int:
    parents = {call["parent_call_id"] for call in calls}
    return sum(call["call_id"] not in parents for call in calls)


@pytest.mark.parametrize("family_engine", ["chatml"], indirect=True)
def test_no_episode_is_lost_to_a_rewritten_think_tag(family_engine: FamilyEngine, oracle: HFOracle) -> None:
    rig = start_rig(family_engine.host, family_engine.model_dir)
    outcomes: list[tuple[str, int, int]] = []
    try:
        with contextlib.contextmanager(serve_gateway)(rig) as served:
            for episode in range(EPISODES):
                first_call = len(rig.recorder.calls)
                opened = served.session()
                three_turns(opened, Tap(finished=True), seed=episode)
                calls = served.calls(opened["rollout_id"])
                assert served.seal(opened["rollout_id"], {"reward": 1.0}).status_code == 200
                event, sample = rig.finalize(opened["rollout_id"], sealed=True)
                roots = sum(call["parent_call_id"] is None for call in calls)
                outcomes.append((event.rejection_reason or event.status, roots, leaves(calls)))
                assert event.status == "accepted" and sample is not None, (episode, event, calls)
                engine_calls = rig.recorder.calls[first_call:]
                chain = chain_ending(calls, len(calls) - 1)
                assert_sample_is_what_the_engine_saw(sample, [(engine_calls[i], 0) for i in chain])
                assert_matches_hf(oracle, family_engine.model_dir, sample, greedy=False)
    finally:
        rig.close()
    # The seeds make the model write <think> in some replies, so both cases happened: a new
    # root, and one root with two leaves (which the ledger alone would reject as ambiguous).
    assert any(roots > 1 for _, roots, _ in outcomes), outcomes
    assert any(roots == 1 and leaves > 1 for _, roots, leaves in outcomes), outcomes
