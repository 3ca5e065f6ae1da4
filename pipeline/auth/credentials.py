"""Role credentials: loaded from files or environment variables, minted for single-machine runs.

A credential is a bearer secret that grants one role. Secrets never come from argv (it
shows in ``ps``), are never logged, and are compared in constant time. A principal is
named by its role and a fingerprint of its secret (``operator:1a2b3c4d``), which says
which credential acted without revealing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class Role(StrEnum):
    AGENT = "agent"
    """Model calls on one rollout (a capability, ``pipeline.auth.capability``)."""
    ENVIRONMENT = "environment"
    """Opens, seals and describes rollouts: the only reward authority besides the operator."""
    SERVICE = "service"
    """The gateway and drivers: generation with ``ng_capture`` on the workers."""
    OPERATOR = "operator"
    """Refits, pause, weight versions, every admin route; may also do what the environment does."""
    CLIENT = "client"
    """Plain generation without capture (vLLM's ``--api-key``); open when no key is set."""


ROLE_FILES: Mapping[Role, str] = {
    Role.OPERATOR: "operator.token",
    Role.ENVIRONMENT: "environment.token",
    Role.SERVICE: "service.token",
    Role.CLIENT: "api.key",
}
ROLE_VARIABLES: Mapping[Role, str] = {
    Role.OPERATOR: "TOKENTRAIL_OPERATOR_TOKEN",
    Role.ENVIRONMENT: "TOKENTRAIL_ENVIRONMENT_TOKEN",
    Role.SERVICE: "TOKENTRAIL_SERVICE_TOKEN",
    Role.CLIENT: "TOKENTRAIL_API_KEY",
}
AGENT_KEY_FILE = "agent.key"
AGENT_KEY_VARIABLE = "TOKENTRAIL_AGENT_KEY"
MIN_SECRET_CHARS = 32
"""At least 128 bits of a URL-safe alphabet and then some; shorter secrets are refused."""
MINTED_ROLES = (Role.OPERATOR, Role.ENVIRONMENT, Role.SERVICE, Role.CLIENT)
"""Every role: a run's worker then serves plain generation only to holders of ``api.key``,
which no agent gets (an agent holds its rollout's capability, good only on the gateway)."""
CREDENTIALS_DIR = "credentials"
"""Under a run's data directory: where ``tokentrail run`` mints its credentials."""


class CredentialError(ValueError):
    """A credential file or variable is unusable; the message names it, never its content."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who made a request: a role and a name safe to log (never the secret)."""

    role: Role | None
    name: str

    def __str__(self) -> str:
        return self.name


ANONYMOUS = Principal(None, "anonymous")


def fingerprint(secret: str) -> str:
    """Eight hex digits of the secret's SHA-256: tells credentials apart, reveals nothing."""
    return hashlib.sha256(secret.encode()).hexdigest()[:8]


@dataclass(frozen=True, slots=True, repr=False)
class Credentials:
    """The role secrets one process knows (to check, or to present), and the agent key."""

    tokens: Mapping[Role, str] = field(default_factory=dict)
    agent_key: bytes | None = None

    def __repr__(self) -> str:
        return f"Credentials(roles={sorted(self.tokens)}, agent_key={self.agent_key is not None})"

    @property
    def enabled(self) -> bool:
        """Whether any role is checked; without, every role route is open (loopback only)."""
        return any(role != Role.CLIENT for role in self.tokens)

    def token(self, role: Role) -> str | None:
        return self.tokens.get(role)

    def authenticate(self, presented: str) -> Principal | None:
        """The principal whose secret this is; every configured secret is compared, in constant time."""
        found: Principal | None = None
        candidate = presented.encode()
        for role, secret in self.tokens.items():
            if hmac.compare_digest(candidate, secret.encode()):
                found = Principal(role, f"{role}:{fingerprint(secret)}")
        return found

    def authorization(self, role: Role) -> dict[str, str]:
        """Headers presenting ``role``'s secret, or none when this process has none."""
        secret = self.tokens.get(role)
        return {} if secret is None else {"authorization": f"Bearer {secret}"}

    @classmethod
    def load(cls, directory: Path | None, environ: Mapping[str, str] | None = None) -> Credentials:
        """Secrets from ``directory`` (its role files) and the environment; a variable wins."""
        environ = os.environ if environ is None else environ
        tokens: dict[Role, str] = {}
        for role, name in ROLE_FILES.items():
            secret = _secret(directory, name, ROLE_VARIABLES[role], environ)
            if secret is not None:
                tokens[role] = secret
        key = _secret(directory, AGENT_KEY_FILE, AGENT_KEY_VARIABLE, environ)
        agent_key = None if key is None else key.encode()
        return cls(tokens, agent_key)

    @classmethod
    def mint(cls, directory: Path) -> Credentials:
        """The operator, environment and service secrets, the client key and the agent key in ``directory``
        (mode 0700, files 0600), keeping those already there: a run's children and a later
        run read the same ones."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        for name in [ROLE_FILES[role] for role in MINTED_ROLES] + [AGENT_KEY_FILE]:
            path = directory / name
            with contextlib.suppress(FileExistsError):
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(descriptor, "w") as out:
                    out.write(secrets.token_urlsafe(32) + "\n")
        return cls.load(directory, environ={})

    def without(self, *roles: Role) -> Credentials:
        """The same credentials less ``roles`` (what a child that must not hold them gets)."""
        return Credentials({r: s for r, s in self.tokens.items() if r not in roles}, self.agent_key)


def _secret(directory: Path | None, name: str, variable: str, environ: Mapping[str, str]) -> str | None:
    """The variable's value, else the file's; checked, and named in any error by its source."""
    if environ.get(variable):
        return _checked(environ[variable], variable)
    if directory is None:
        return None
    path = directory / name
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CredentialError(f"{path}: cannot be read ({exc.strerror})") from None
    return _checked(text, str(path))


def _checked(value: str, source: str) -> str:
    value = value.strip()
    if len(value) < MIN_SECRET_CHARS:
        raise CredentialError(f"{source}: a secret needs at least {MIN_SECRET_CHARS} characters")
    if any(c.isspace() for c in value):
        raise CredentialError(f"{source}: a secret has no whitespace")
    return value


__all__ = [
    "AGENT_KEY_FILE",
    "ANONYMOUS",
    "CredentialError",
    "Credentials",
    "Principal",
    "Role",
    "fingerprint",
]
