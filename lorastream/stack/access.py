"""The tokens and local roots `lorastream up` gives its stack (docs/security.md).

By default the stack makes an operate token (the store's changes, the workers' load/unload, the
gateway's operator API) and a read token (the workers' fetches from the store); they reach the
children through their environment, never their command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from lorastream.core.auth import AccessTokens, generate_token
from lorastream.core.local_paths import absolute_source

DEFAULT_TOKEN_FILE = Path.home() / ".cache" / "lorastream" / "up-operator-token"


def stack_tokens(operate: str | None, insecure_no_auth: bool) -> AccessTokens:
    """The stack's tokens: ``operate`` (given by the user) or a fresh one, and a fresh read
    token; with ``insecure_no_auth`` none is made (only a given one is used)."""
    if insecure_no_auth:
        return AccessTokens(operate=operate)
    return AccessTokens(operate=operate or generate_token(), read=generate_token())


def local_roots(
    samples_dir: Path, adapters: dict[str, str], allowed: Sequence[str] = ()
) -> list[str]:
    """The directories the stack's store may stage local adapters from: the samples, each
    local ``--adapter`` directory (``adapters``: name -> URI) and the ``allowed`` ones
    (``up --allowed-local-root``, each comma-separated part made absolute from here, as the
    store splits them)."""
    roots = [str(samples_dir)]
    for uri in adapters.values():
        parts = urlsplit(uri)
        if parts.scheme in ("", "file"):
            roots.append(unquote(parts.path) if parts.scheme else uri)
    for item in allowed:
        roots += [absolute_source(part.strip()) for part in item.split(",") if part.strip()]
    return list(dict.fromkeys(roots))


def present(variables: dict[str, str | None]) -> dict[str, str]:
    """The variables that have a value (a token the stack does not use is left unset)."""
    return {name: value for name, value in variables.items() if value}
