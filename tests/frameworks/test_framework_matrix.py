"""Agent frameworks on reasoning families: one three-call episode each, through the gateway.

Agents reach reasoning models through frameworks that keep their own history and send a
reply back rewritten (reasoning dropped, moved into tags or another field, made an item
of its own). Each case is one unmodified framework given only what a session hands out
(a base URL and a key): pydantic-ai's OpenAI chat, Responses and Anthropic models,
openai-agents' chat and Responses models (plain and streamed), LangChain's ChatOpenAI,
and the official SDKs' own loops. Each plays one episode on a family's tiny model: a
question; a request for the add tool, the call and its result (the agent's own code adds
the call, since a random model never makes one; the framework runs the tool where it
can); a follow-up. The gateway must find each parent from the history the framework sent
(one chain), the seal must give an accepted rollout, and its sample must be the engine's
ids and logprobs exactly and a Hugging Face forward's within 1e-4.

The tiny model never closes its reasoning within a few tokens, so every reply is
reasoning cut at ``max_tokens`` with no visible text. pydantic-ai and openai-agents refuse
such a reply (a token budget spent before any output), so their clients see a cut reply
as finished: only its finish reason changes, as a real model's reply that stopped after
its reasoning would read. Their history handling then runs as it would for that model.
A case that breaks says how in its table cell, and its failure shows the history the
framework sent and the reply it got.
"""

from __future__ import annotations

import contextlib

import orjson
import pytest
from enginekit import HFOracle, assert_matches_hf, assert_sample_is_what_the_engine_saw, start_rig
from familykit import FamilyEngine
from frameworkkit import (
    CALLS,
    CASES,
    EXACT,
    TOOL_RESULT,
    BrokenChain,
    RefusedHistory,
    Tap,
    chain_ending,
    compact,
    what_went_back,
)
from gatewaykit import serve_gateway

from topics.wire import COORDS_FIELD

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.mark.parametrize("name", list(CASES))
def test_framework_episode(
    family_engine: FamilyEngine,
    name: str,
    oracle: HFOracle,
    framework_results: dict[tuple[str, str], str],
) -> None:
    """One episode of ``name`` through the gateway: one chain, accepted, exact."""
    case, key = CASES[name], (name, family_engine.family)
    framework_results[key] = "**failed**"

    def broken(outcome: str, failure: AssertionError) -> AssertionError:
        """The outcome in the table, and the failure that explains it."""
        framework_results[key] = outcome
        return failure

    tap = Tap(finished=case.finished)
    rig = start_rig(family_engine.host, family_engine.model_dir)
    try:
        with contextlib.contextmanager(serve_gateway)(rig) as served:
            opened = served.session()
            rollout_id = opened["rollout_id"]
            try:
                case.play(opened, tap)
            except Exception as error:
                refused = tap.refused()
                if refused is None or refused[0] == 0:
                    raise
                index, exchange = refused
                raise broken(
                    f"**call {index + 1} refused** ({exchange.status})",
                    RefusedHistory(
                        f"{exchange.status} {compact(orjson.loads(exchange.reply))}; "
                        + what_went_back(tap.exchanges, index)
                    ),
                ) from error
            calls = served.calls(rollout_id)
            assert served.seal(rollout_id, {"reward": 1.0}).status_code == 200
            event, sample = rig.finalize(rollout_id, sealed=True)
    finally:
        rig.close()
    engine_calls = rig.recorder.calls
    assert len(calls) == len(engine_calls) == len(tap.exchanges) == CALLS, (calls, tap.exchanges)
    assert all(exchange.status == 200 for exchange in tap.exchanges)
    assert all(COORDS_FIELD.encode() not in exchange.reply for exchange in tap.exchanges)
    assert event.status == "accepted" and sample is not None, event
    # The sample is the chain the episode ended in: the whole episode when it is one chain.
    chain = chain_ending(calls, len(calls) - 1)
    assert_sample_is_what_the_engine_saw(sample, [(engine_calls[i], 0) for i in chain])
    assert_matches_hf(oracle, family_engine.model_dir, sample)
    assert TOOL_RESULT in rig.worker.renderer.tokenizer.decode(sample.token_ids)
    parents = [call["parent_call_id"] for call in calls]
    if parents != [None, *(call["call_id"] for call in calls[:-1])]:
        first = next(i for i in range(1, len(calls)) if parents[i] != calls[i - 1]["call_id"])
        raise broken(
            f"**{parents.count(None)} roots**, accepted, exact (the last call's chain)",
            BrokenChain(f"parents {parents}: " + what_went_back(tap.exchanges, first)),
        )
    framework_results[key] = EXACT
