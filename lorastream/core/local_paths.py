"""Local adapter paths as the user means them: relative to the shell they typed them in."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit


def absolute_source(uri: str) -> str:
    """A relative (or ``~``) local path made absolute against the current directory; URIs
    (``s3://``, ``hf://``, ``file://``) and absolute paths unchanged.

    The store resolves plain paths on its own host and refuses relative ones (they would depend
    on its working directory), so clients send the path the user meant: the one from here."""
    if urlsplit(uri).scheme or Path(uri).is_absolute():
        return uri
    return str(Path(uri).expanduser().resolve())
