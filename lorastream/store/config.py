"""Adapter store configuration: the one place the store reads its environment.

Every field is an environment variable ``LORASTREAM_STORE_<FIELD>`` and, unless marked
``CliSuppress`` (a token or a test hook), a ``lorastream store serve`` flag generated from it
(lorastream/cli/settings_flags.py: name, default and help come from here); the Hub and S3 settings
also honour the standard variables those ecosystems use (``HF_ENDPOINT``, ``HF_TOKEN``,
``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, CliSuppress, NoDecode, SettingsConfigDict

from lorastream.core.auth import AccessTokens, read_token_file
from lorastream.core.checksum import DEFAULT_TENSOR_DIGEST

DEFAULT_CHUNK_BYTES = 1 << 20


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "lorastream" / "store"


class StoreSettings(BaseSettings):
    """Settings of one adapter store process."""

    model_config = SettingsConfigDict(
        env_prefix="LORASTREAM_STORE_", extra="ignore", populate_by_name=True
    )

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 to serve other hosts.")
    port: int = Field(50051, description="gRPC port; 0 picks a free one.")
    tls_cert: Path | None = Field(
        None,
        description="Serve over TLS with this certificate (PEM; with its chain); needs --tls-key.",
    )
    tls_key: Path | None = Field(None, description="Private key (PEM) of --tls-cert.")
    tls_client_ca: Path | None = Field(
        None,
        description="Mutual TLS: accept only clients presenting a certificate signed by this CA "
        "(PEM); others are refused at the handshake.",
    )
    cache_dir: Path = Field(
        default_factory=_default_cache_dir, description="Where adapters are staged on disk."
    )
    cache_bytes: int = Field(
        20 << 30, gt=0, description="Disk budget for staged adapters; LRU evicts unpinned ones."
    )
    chunk_bytes: int = Field(
        DEFAULT_CHUNK_BYTES,
        gt=0,
        le=4 << 20,
        description="Default StreamAdapterTensors chunk size (1 MiB is fastest on loopback).",
    )
    max_header_bytes: int = Field(
        16 << 20, gt=0, description="Largest safetensors header accepted (guards against bombs)."
    )
    max_upload_bytes: int = Field(
        4 << 30,
        gt=0,
        description="Largest adapter one push (UploadAdapter) may send, in bytes; larger "
        "uploads are refused before their bytes are read.",
    )
    tensor_digest: Literal["xxh3-128", "blake3", "sha256"] = Field(
        DEFAULT_TENSOR_DIGEST,
        description="Per-tensor digest computed at staging and checked by workers on landing "
        "(sha256 is always computed too, for the content id): xxh3-128 (fastest; catches "
        "corruption), blake3 (also tamper-evident), sha256 (no fast digest). docs/store.md.",
    )
    max_workers: int = Field(16, gt=0, description="gRPC thread pool size.")
    egress_limit_mbps: float = Field(
        0.0,
        ge=0,
        description="Cap on the bytes per second (MB/s, 1e6) all streams send together; "
        "0: no cap. Keeps adapter streams from saturating a shared NIC (125: a 1 Gb/s link).",
    )
    egress_burst_bytes: int = Field(
        0,
        ge=0,
        description="Idle link time, in bytes at the egress cap, that a sender which fell "
        "behind may catch up at once (a token bucket's depth; a real link drains the socket "
        "send buffer while the store is off the CPU). 0: every chunk waits for its own slot.",
    )
    stream_chunk_delay_s: CliSuppress[float] = Field(
        0.0, ge=0, description="Test hook: sleep this long before sending each stream chunk."
    )
    token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_STORE_TOKEN", "LORASTREAM_TOKEN"),
        description="Operate-scope bearer token: required on preload, push, delete, pin, "
        "unpin; also reads.",
    )
    token_file: Path | None = Field(
        None, description="File holding the operate token (first line) [instead of the variable]."
    )
    read_token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_STORE_READ_TOKEN", "LORASTREAM_READ_TOKEN"),
        description="Read-scope bearer token: list, describe and stream weights (what workers "
        "use). With any token set, reads need this one or the operate token.",
    )
    read_token_file: Path | None = Field(
        None, description="File holding the read token (first line) [instead of the variable]."
    )
    insecure_no_auth: bool = Field(
        False,
        description="Serve a non-loopback --host with no token (anyone reaching the port may "
        "download and change every adapter). Off: such a store refuses to start.",
    )
    allowed_local_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Directories local adapter paths must be under (symlinks resolved); "
        "repeat, or comma-separate. None given: local paths are refused.",
    )
    hf_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_STORE_HF_ENDPOINT", "HF_ENDPOINT"),
        description="Hugging Face Hub endpoint (a mirror, or a test server).",
    )
    hf_token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_STORE_HF_TOKEN", "HF_TOKEN"),
        description="Token for private Hub repos.",
    )
    s3_endpoint_url: str | None = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_STORE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"),
        description="S3-compatible endpoint (MinIO, R2); unset: AWS.",
    )
    s3_max_concurrency: int = Field(8, gt=0, description="Parallel parts of one S3 download.")
    s3_max_attempts: int = Field(5, gt=0, description="botocore retry attempts per S3 call.")
    metrics_port: int | None = Field(
        9451,
        ge=0,
        description="Serve Prometheus metrics on http://HOST:PORT/metrics (plain HTTP, on "
        "--host; 0: any free port). docs/metrics.md lists them.",
    )

    @field_validator("allowed_local_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        items = [value] if isinstance(value, (str, Path)) else value
        if not isinstance(items, list):
            return value
        return [part.strip() for item in items for part in str(item).split(",") if part.strip()]

    def access_tokens(self) -> AccessTokens:
        """The tokens this store accepts, read from the variables or the token files."""
        operate = self.token or (
            read_token_file(self.token_file, "--token-file") if self.token_file else None
        )
        read = self.read_token or (
            read_token_file(self.read_token_file, "--read-token-file")
            if self.read_token_file else None
        )
        return AccessTokens(operate=operate, read=read)
