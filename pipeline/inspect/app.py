"""The inspector's FastAPI app: server-rendered pages behind the operator credential.

Every route is in ``inspect_policy`` and guarded by the project's ``AuthGate``. A browser
cannot send a bearer header when it navigates, so ``CookieLogin`` sits in front of the
gate: ``?token=`` with the operator token, once, sets an HttpOnly, SameSite=Strict cookie
and redirects to the same URL without it; later requests carry the cookie, which the
login turns into the ``Authorization`` header the gate reads. With no credentials at all
(open mode) the gate admits everyone, and ``check_bind`` keeps that on loopback.
"""

from __future__ import annotations

from importlib.resources import files
from urllib.parse import parse_qsl, urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.auth.audit import Audit
from pipeline.auth.credentials import Credentials, Role
from pipeline.auth.gate import PUBLIC, Access, AuthGate, needs
from pipeline.inspect.charts import run_charts
from pipeline.inspect.source import RunSource
from pipeline.inspect.table import STATUSES, TableQuery, member_advantages
from pipeline.inspect.timeline import duration, utc

COOKIE = "tokentrail_inspect"
PACKAGE = files("pipeline.inspect")


def inspect_policy() -> dict[str, Access]:
    """Every route: the pages need the operator, the static files and health are public."""
    operator = needs(Role.OPERATOR)
    return {
        "/": operator,
        "/rollouts": operator,
        "/rollouts/{rollout_id}": operator,
        "/samples/{sample_key}/tokens": operator,
        "/groups/{group_id}": operator,
        "/steps": operator,
        "/steps/{name}": operator,
        "/pipeline": operator,
        "/static": PUBLIC,
        "/health": PUBLIC,
    }


class CookieLogin:
    """``?token=`` → cookie and a clean redirect; cookie → bearer header for the gate."""

    def __init__(self, app: ASGIApp, *, secure: bool) -> None:
        self.app = app
        self.secure = secure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        token = next((value for key, value in query if key == "token"), None)
        if token is not None:
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            target = scope["path"] + (f"?{rest}" if rest else "")
            reply = RedirectResponse(target, status_code=303)
            reply.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=self.secure, path="/")
            await reply(scope, receive, send)
            return
        headers = Headers(scope=scope)
        cookie = _cookie(headers.get("cookie", ""))
        if cookie and "authorization" not in headers:
            scope = {**scope, "headers": [*scope["headers"], (b"authorization", f"Bearer {cookie}".encode())]}
        await self.app(scope, receive, send)


def _cookie(header: str) -> str | None:
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE and value:
            return value
    return None


def create_inspect_app(source: RunSource, credentials: Credentials, *, secure: bool = False) -> FastAPI:
    app = FastAPI(
        title="tokentrail inspect", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    templates = Jinja2Templates(directory=str(PACKAGE / "templates"))
    templates.env.globals["source"] = source
    templates.env.filters.update(utc=utc, duration=duration)
    app.mount("/static", StaticFiles(directory=str(PACKAGE / "static")), name="static")
    app.add_middleware(
        AuthGate, router=app.router, policy=inspect_policy(), credentials=credentials, audit=Audit()
    )
    app.add_middleware(CookieLogin, secure=secure)

    def render(request: Request, name: str, status: int = 200, **context: object) -> HTMLResponse:
        return templates.TemplateResponse(request, name, context, status_code=status)

    def missing(request: Request, what: str, key: str) -> HTMLResponse:
        return render(request, "missing.html", 404, what=what, key=key)

    @app.get("/")
    async def home() -> Response:
        return RedirectResponse("/rollouts", status_code=303)

    @app.get("/rollouts")
    async def rollouts(
        request: Request,
        status: str | None = None,
        q: str = "",
        sort: str = "rollout",
        desc: bool = False,
        page: int = 1,
        per_page: int = 50,
    ) -> HTMLResponse:
        found = source.table.page(TableQuery(status or None, q, sort, desc, page, per_page))
        return render(request, "rollouts.html", found=found, statuses=STATUSES)

    @app.get("/rollouts/{rollout_id}")
    async def rollout(request: Request, rollout_id: str) -> HTMLResponse:
        row = source.table.get(rollout_id)
        if row is None:
            return missing(request, "rollout", rollout_id)
        return render(request, "rollout.html", row=row, detail=source.rollout(rollout_id))

    @app.get("/samples/{sample_key}/tokens")
    async def tokens(request: Request, sample_key: str, step: str | None = None) -> HTMLResponse:
        log = None if step is None else source.steps.get(step)
        if step is not None and log is None:
            return missing(request, "train step", step)
        try:
            view = source.tokens(sample_key, log)
        except ValueError as exc:  # a step file whose logprobs do not fit the sample
            return render(request, "missing.html", 409, what="usable train step", key=str(exc))
        if view is None:
            return missing(request, "sample", sample_key)
        return render(request, "tokens.html", view=view, steps=source.steps_of(sample_key))

    @app.get("/steps")
    async def steps(request: Request) -> HTMLResponse:
        steps = list(source.steps.values())
        return render(request, "steps.html", steps=steps, charts=run_charts(steps))

    @app.get("/steps/{name}")
    async def step(request: Request, name: str) -> HTMLResponse:
        log = source.steps.get(name)
        if log is None:
            return missing(request, "train step", name)
        return render(request, "step.html", log=log, report=log.mismatch)

    @app.get("/groups/{group_id}")
    async def group(request: Request, group_id: str) -> HTMLResponse:
        members = source.table.group(group_id)
        if not members:
            return missing(request, "group", group_id)
        rewards = [m.reward for m in members if m.status == "accepted" and m.reward is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        return render(
            request,
            "group.html",
            group_id=group_id,
            members=members,
            mean=mean,
            advantages=member_advantages(members),
        )

    @app.get("/pipeline")
    async def pipeline(request: Request) -> HTMLResponse:
        return render(request, "pipeline.html")

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "rollouts": len(source.table), "log": source.log_problem or "read"}

    return app
