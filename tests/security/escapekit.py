"""The escape suite's report: each attack's answer by surface and route, as a README table."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class EscapeReport:
    """Each attack's answer by surface and route, and whether the state survived them all."""

    answers: dict[tuple[str, str], Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    methods: dict[tuple[str, str], set[str]] = field(default_factory=lambda: defaultdict(set))
    unchanged: bool | None = None

    def record(self, surface: str, route: str, method: str, status: int) -> None:
        self.answers[surface, route][status] += 1
        self.methods[surface, route].add(method)

    def markdown(self) -> str:
        total = sum(sum(c.values()) for c in self.answers.values())
        state = {True: "nothing changed", False: "STATE CHANGED", None: "not checked"}[self.unchanged]
        lines = [
            f"{total} attacks, each with the agent's key (as bearer and as `x-api-key`, on its own "
            f"rollout where the route is not its own and on another's), a forged key, or none. "
            f"Afterwards: {state} (both rollouts open, weight version and pause state, no event, "
            "no row staged).",
            "",
            "| surface | route | methods | attacks | refused 401 · 403 · 404 |",
            "|---|---|---|---:|---|",
        ]
        for (surface, route), statuses in sorted(self.answers.items()):
            refused = " · ".join(str(statuses.get(code, 0)) for code in (401, 403, 404))
            methods = ", ".join(sorted(self.methods[surface, route]))
            lines.append(f"| {surface} | `{route}` | {methods} | {sum(statuses.values())} | {refused} |")
        return "\n".join(lines) + "\n"
