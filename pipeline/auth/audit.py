"""The audit trail: every control action and every refused credential, logged and counted.

One log line per event on the ``tokentrail.audit`` logger, naming the principal (never
its secret), the action and its outcome (the HTTP status answered), plus counters in the
process's metrics registry.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("tokentrail.audit")


class Audit:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.actions = Counter(
            "tokentrail_control_actions",
            "Control actions (open, seal, refit, pause, weight version, ...) by outcome",
            ["action", "outcome"],
            registry=registry,
        )
        self.refusals = Counter(
            "tokentrail_auth_refusals",
            "Requests refused for their credential: missing, invalid or of the wrong role",
            ["reason"],
            registry=registry,
        )

    def action(self, action: str, principal: str, status: int, *, target: str | None = None) -> None:
        outcome = "ok" if status < 400 else "refused" if status < 500 else "error"
        self.actions.labels(action, outcome).inc()
        log.info(
            "audit action=%s principal=%s target=%s status=%d outcome=%s",
            action,
            principal,
            target or "-",
            status,
            outcome,
        )

    def refused(self, reason: str, principal: str, method: str, path: str) -> None:
        self.refusals.labels(reason).inc()
        log.warning("audit refused=%s principal=%s %s %s", reason, principal, method, path[:200])


__all__ = ["Audit"]
