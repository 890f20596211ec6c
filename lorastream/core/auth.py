"""Scoped bearer tokens, shared by the store, the worker and the gateway.

Two scopes:

- ``read``: list and describe adapters and stream their weights (what a worker needs from the
  store);
- ``operate``: change what is staged or loaded (preload, pin, unpin, delete on the store; load
  and unload on a worker; the gateway's operator API). An operate token may also read.

A server with no token at all is open (loopback development); a server with any token requires,
on each protected call, a token of a scope that covers the call. Tokens are compared in constant
time and never logged, and they come from the environment or from files, not from argv.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from lorastream.core.errors import InvalidArgument


class Scope(enum.Enum):
    READ = "read"
    OPERATE = "operate"


@dataclass(frozen=True)
class AccessTokens:
    """The tokens a server accepts; ``None``: that scope has no token."""

    operate: str | None = None
    read: str | None = None

    @property
    def enabled(self) -> bool:
        """True when the server requires tokens (any is configured)."""
        return bool(self.operate or self.read)

    def describe(self) -> str:
        """Which tokens are set, for the start-up log (never the tokens themselves)."""
        if not self.enabled:
            return "no token: every call is open"
        scopes = [s.value for s, token in ((Scope.OPERATE, self.operate), (Scope.READ, self.read))
                  if token]
        return f"guarded calls need a token; tokens set: {', '.join(scopes)}"

    def scopes_of(self, presented: str | None) -> frozenset[Scope]:
        """The scopes ``presented`` grants: operate includes read; none for a wrong token."""
        if not presented:
            return frozenset()
        if _matches(presented, self.operate):
            return frozenset({Scope.OPERATE, Scope.READ})
        if _matches(presented, self.read):
            return frozenset({Scope.READ})
        return frozenset()

    def allows(self, presented: str | None, scope: Scope) -> bool:
        """True when a call needing ``scope`` may proceed with ``presented``."""
        return not self.enabled or scope in self.scopes_of(presented)


def _matches(presented: str, expected: str | None) -> bool:
    if not expected:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def bearer_of(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def read_token_file(path: Path, what: str) -> str:
    """The token in ``path`` (its first line, stripped); InvalidArgument naming ``what`` when the
    file is missing or empty."""
    try:
        text = path.read_text()
    except OSError as err:
        raise InvalidArgument(f"{what}: cannot read {path}: {err.strerror}") from None
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not token:
        raise InvalidArgument(f"{what}: {path} is empty; put the token on its first line")
    return token


def read_token_list_file(path: Path, what: str) -> list[str]:
    """Tokens one per line in ``path`` (blank lines and ``#`` comments skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise InvalidArgument(f"{what}: cannot read {path}: {err.strerror}") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def write_secret_file(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` readable by its owner only (mode 0600 from the start)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")


def is_loopback(host: str) -> bool:
    """True when binding ``host`` serves this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_open_bind(host: str, tokens_set: bool, insecure: bool, what: str, hint: str) -> None:
    """InvalidArgument when ``what`` would serve other hosts (``host`` not loopback) with no
    token and without ``--insecure-no-auth``; ``hint`` names the settings that set tokens."""
    if tokens_set or insecure or is_loopback(host):
        return
    raise InvalidArgument(
        f"the {what} binds {host}, which other hosts reach, but has no token: anyone could "
        f"use it. Set {hint}, or pass --insecure-no-auth to serve it open anyway"
    )
