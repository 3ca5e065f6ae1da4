"""A session's opening, carried in its agent key: any replica can open what another opened.

An opened session with no call yet is on no log, so a replica asked for it (the one the
deployment routes its rollout id to, or the one left after its opener died) would not
know it. Its ``group_id`` and ``history`` are therefore the terms of the agent's key
(``pipeline.auth.capability``), bound by the key's MAC: a replica that finds nothing of
the rollout on the log opens it from the key the agent presents. A session opened with
neither keeps the plain key.
"""

from __future__ import annotations

from typing import get_args

import orjson

from topics.records import HistoryPolicy

Opening = tuple[str | None, HistoryPolicy]
"""``(group_id, history)``, as ``POST /rollouts`` chose them."""


def terms_of(group_id: str | None, history: HistoryPolicy) -> str:
    """The key's terms for an opening ("" for the default one)."""
    if group_id is None and history == "exact":
        return ""
    return orjson.dumps({"group_id": group_id, "history": history}, option=orjson.OPT_SORT_KEYS).decode()


def opening_of(terms: str) -> Opening:
    """The opening a verified key's terms describe (the default one for no terms)."""
    if not terms:
        return None, "exact"
    read = orjson.loads(terms)
    group_id, history = read.get("group_id"), read.get("history")
    if not (group_id is None or isinstance(group_id, str)) or history not in get_args(HistoryPolicy):
        raise ValueError(f"terms: {terms[:80]!r} is not a session's opening")
    return group_id, history


__all__ = ["Opening", "opening_of", "terms_of"]
