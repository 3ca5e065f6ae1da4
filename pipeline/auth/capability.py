"""The agent's credential: a capability for exactly one rollout.

``issue(rollout_id)`` is an HMAC-SHA256 of the rollout id under the gateway's agent key
(256 bits, URL-safe), so it is unguessable without the key, bound to that rollout by
construction, and needs no state: a restarted gateway given the same key still honours
the capabilities of the sessions it recovers. It dies with its rollout: the gateway
answers nothing but "sealed" once the session is sealed (by the environment or the TTL).
Rollout ids must therefore not be reused (DESIGN §15).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

PREFIX = "tta_"
_DOMAIN = b"tokentrail agent capability v1\n"


class AgentCapabilities:
    def __init__(self, key: bytes | None = None) -> None:
        """``key`` None: a fresh one in memory (capabilities then end with the process)."""
        self._key = key if key is not None else secrets.token_bytes(32)

    def issue(self, rollout_id: str) -> str:
        mac = hmac.new(self._key, _DOMAIN + rollout_id.encode(), hashlib.sha256).digest()
        return PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def verify(self, rollout_id: str, presented: str) -> bool:
        return hmac.compare_digest(self.issue(rollout_id).encode(), presented.encode())


__all__ = ["PREFIX", "AgentCapabilities"]
