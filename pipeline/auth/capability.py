"""The agent's credential: a capability for exactly one rollout.

``issue(rollout_id)`` is an HMAC-SHA256 of the rollout id under the gateway's agent key
(256 bits, URL-safe), so it is unguessable without the key, bound to that rollout by
construction, and needs no state: a restarted gateway given the same key still honours
the capabilities of the sessions it recovers. It dies with its rollout: the gateway
answers nothing but "sealed" once the session is sealed (by the environment or the TTL).
Rollout ids must therefore not be reused (DESIGN §15).

A capability may also carry *terms*: a short text the issuer binds into the MAC and
appends in the clear (``tta_MAC.TERMS``), which ``terms`` reads back. The gateway puts a
session's opening there (``pipeline.gateway.opening``), so a replica that never saw the
opening can open the session as it was opened: the agent can read its terms, never
change them.
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

    def issue(self, rollout_id: str, terms: str = "") -> str:
        bound = _DOMAIN + rollout_id.encode() + (b"\n" + terms.encode() if terms else b"")
        mac = hmac.new(self._key, bound, hashlib.sha256).digest()
        issued = PREFIX + _b64(mac)
        return issued + "." + _b64(terms.encode()) if terms else issued

    def verify(self, rollout_id: str, presented: str) -> bool:
        return hmac.compare_digest(self.issue(rollout_id, self.terms(presented)).encode(), presented.encode())

    @staticmethod
    def terms(presented: str) -> str:
        """The terms a capability carries ("" for none, or for text that is not a capability's);
        to be trusted only once ``verify`` accepted it."""
        _, dot, encoded = presented.partition(".")
        if not dot:
            return ""
        try:
            return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
        except (ValueError, UnicodeDecodeError):
            return ""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


__all__ = ["PREFIX", "AgentCapabilities"]
