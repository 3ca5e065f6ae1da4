"""The route gate: every route of an app declares who may call it, and the gate enforces it.

``AuthGate`` is ASGI middleware in front of the app's router. It finds the route a
request is for, looks up its ``Access`` in the app's policy, and admits the request only
with a credential of one of its roles (``Authorization: Bearer`` or ``x-api-key``, which
is how the official SDKs send ``api_key``). A route missing from the policy is refused
(fail closed), and ``unguarded_routes`` lets a test find one before a user does. The
admitted principal is in ``request.state.principal``. Refusals are answered in the
route's API shape: 401 for a missing or unknown credential, 403 for a known one of the
wrong role; nothing reaches the handler, so nothing is published, staged or changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.routing import BaseRoute, Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.api.protocols import CHAT, Protocol
from pipeline.auth.audit import Audit
from pipeline.auth.capability import AgentCapabilities
from pipeline.auth.credentials import ANONYMOUS, Credentials, Principal, Role

ROLLOUT_PARAM = "rollout_id"
OPEN_MODE_ROLES = frozenset({Role.ENVIRONMENT, Role.SERVICE, Role.OPERATOR, Role.CLIENT})


@dataclass(frozen=True, slots=True)
class Access:
    """Who may call a route: ``roles`` (any one), or anyone when ``public``.

    ``Role.AGENT`` means the capability of the rollout named by the route's
    ``rollout_id``. ``action`` names a control action, audited with its outcome;
    ``protocol`` is the API whose shape the route's errors take.
    """

    roles: frozenset[Role] = frozenset()
    public: bool = False
    action: str | None = None
    protocol: Protocol = CHAT


PUBLIC = Access(public=True)


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    reason: str
    """missing, invalid or wrong_role: the label it is counted under."""
    message: str


def needs(*roles: Role, action: str | None = None, protocol: Protocol = CHAT) -> Access:
    if not roles:
        raise ValueError("roles: a guarded route needs at least one role (or PUBLIC)")
    return Access(frozenset(roles), action=action, protocol=protocol)


def principal_of(request: Request) -> Principal:
    """Who the gate admitted this request as."""
    principal: Principal = request.state.principal
    return principal


def unguarded_routes(app: FastAPI, policy: Mapping[str, Access]) -> list[str]:
    """Paths of ``app``'s routes that the policy does not name (each one is refused)."""
    return sorted({path for path in _paths(app.router.routes) if path not in policy})


def _paths(routes: Iterable[BaseRoute]) -> Iterable[str]:
    for route in routes:
        path = getattr(route, "path", None)
        if isinstance(path, str):
            yield path


def presented_secret(headers: Headers) -> str | None:
    """The bearer token (OpenAI's SDK) or the ``x-api-key`` header (Anthropic's)."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


class AuthGate:
    """ASGI middleware; add it with ``app.add_middleware(AuthGate, router=app.router, ...)``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        router: Router,
        policy: Mapping[str, Access],
        credentials: Credentials,
        audit: Audit,
        capabilities: AgentCapabilities | None = None,
    ) -> None:
        self.app = app
        self.router = router
        self.policy = policy
        self.credentials = credentials
        self.capabilities = capabilities
        self.audit = audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = self._route(scope)
        if found is None:  # no such route: the router answers 404 or 405
            await self.app(scope, receive, send)
            return
        path, params = found
        access = self.policy.get(path)
        method, url_path = scope["method"], scope["path"]
        if access is None:
            self.audit.refused("no_policy", "-", method, url_path)
            await CHAT.error(403, f"{path}: this route has no access policy")(scope, receive, send)
            return
        secret = presented_secret(Headers(scope=scope))
        principal = self._admit(access, secret, params)
        if isinstance(principal, Refusal):
            self.audit.refused(principal.reason, "-" if secret is None else "unknown", method, url_path)
            await access.protocol.error(principal.status, principal.message)(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        if access.action is None:
            await self.app(scope, receive, send)
            return
        await self._audited(access.action, principal, params, scope, receive, send)

    def _route(self, scope: Scope) -> tuple[str, Mapping[str, str]] | None:
        partial: tuple[str, Mapping[str, str]] | None = None
        for route in self.router.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                return getattr(route, "path", ""), child.get("path_params", {})
            if match is Match.PARTIAL and partial is None:
                partial = getattr(route, "path", ""), child.get("path_params", {})
        return partial

    def _admit(self, access: Access, secret: str | None, params: Mapping[str, str]) -> Principal | Refusal:
        known = None if secret is None else self.credentials.authenticate(secret)
        if access.public:
            return known or ANONYMOUS
        if Role.AGENT in access.roles and secret is not None and self.capabilities is not None:
            rollout_id = params.get(ROLLOUT_PARAM, "")
            if self.capabilities.verify(rollout_id, secret):
                return Principal(Role.AGENT, f"agent:{rollout_id}")
        if known is not None and known.role in access.roles:
            return known
        if access.roles & OPEN_MODE_ROLES and not self.credentials.enabled:
            return known or ANONYMOUS  # no credentials configured: allowed on loopback only (bind.py)
        if Role.CLIENT in access.roles and self.credentials.token(Role.CLIENT) is None:
            return known or ANONYMOUS  # vLLM's convention: without --api-key, no key is needed
        if secret is None:
            return Refusal(401, "missing", _MISSING)
        if known is None:
            return Refusal(401, "invalid", "authorization: the credential is not valid here")
        wanted = ", ".join(sorted(access.roles))
        return Refusal(
            403, "wrong_role", f"authorization: {known.role} may not call this route (needs {wanted})"
        )

    async def _audited(
        self,
        action: str,
        principal: Principal,
        params: Mapping[str, str],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        status = 500

        async def watching(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watching)
        finally:
            self.audit.action(action, str(principal), status, target=params.get(ROLLOUT_PARAM))


_MISSING = "authorization: a credential is required (Authorization: Bearer, or x-api-key)"

__all__ = ["PUBLIC", "Access", "AuthGate", "needs", "presented_secret", "principal_of", "unguarded_routes"]
