"""The four HTTP APIs the gateway and the worker serve, one object each, and the one
registry that maps an API's name to its object (`base` says what each object knows).

Callers hold a `Protocol` and ask it; none compares API names. A route is served at each
protocol's ``path``, in the registry's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pipeline.api.protocols.base import Protocol
from pipeline.api.protocols.chat import Chat
from pipeline.api.protocols.completions import Completions
from pipeline.api.protocols.messages import Messages
from pipeline.api.protocols.responses import Responses
from topics.wire import Dialect

CHAT: Protocol = Chat()
COMPLETIONS: Protocol = Completions()
RESPONSES: Protocol = Responses()
MESSAGES: Protocol = Messages()

PROTOCOLS: Mapping[Dialect, Protocol] = MappingProxyType(
    {protocol.name: protocol for protocol in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)}
)
"""Each protocol by its name (``topics.wire.Dialect``)."""

__all__ = ["CHAT", "COMPLETIONS", "MESSAGES", "PROTOCOLS", "RESPONSES", "Protocol"]
