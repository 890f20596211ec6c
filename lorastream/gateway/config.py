"""HTTP gateway configuration: the one place the gateway reads its environment.

Every field is an environment variable ``LORASTREAM_GATEWAY_<FIELD>`` and, unless marked
``CliSuppress`` (tokens, kept out of process listings), a ``lorastream gateway serve`` flag
generated from it (lorastream/cli/settings_flags.py: name, default and help come from here).
``LORASTREAM_GATEWAY_WORKERS`` takes a comma-separated list (``host:50052,host:50053``) or a JSON
list; the flag is repeated (``--worker host:50052 --worker host:50053``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import CliSuppress, NoDecode, SettingsConfigDict

from lorastream.core.auth import read_token_file, read_token_list_file
from lorastream.core.errors import InvalidArgument
from lorastream.core.store_tls_settings import StoreTLSSettings


class GatewaySettings(StoreTLSSettings):
    """Settings of one gateway process."""

    model_config = SettingsConfigDict(
        env_prefix="LORASTREAM_GATEWAY_", extra="ignore", populate_by_name=True
    )

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 to serve other hosts.")
    port: int = Field(8000, ge=0, description="HTTP port; 0 picks a free one.")
    tls_cert: Path | None = Field(
        None,
        description="Serve HTTPS with this certificate (PEM; with its chain); needs --tls-key.",
    )
    tls_key: Path | None = Field(None, description="Private key (PEM) of --tls-cert.")
    tls_client_ca: Path | None = Field(
        None,
        description="Mutual TLS: accept only clients presenting a certificate signed by this CA "
        "(PEM); others are refused at the handshake.",
    )
    store: str = Field(
        "localhost:50051",
        validation_alias=AliasChoices("LORASTREAM_GATEWAY_STORE", "LORASTREAM_STORE"),
        description="Adapter store HOST:PORT (the catalogue of /v1/models and operator calls).",
    )
    workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="GPU worker HOST:PORT targets (at least one)."
    )
    worker_tls_ca: Path | None = Field(
        None,
        description="Connect to the workers over TLS, trusting this CA (PEM).",
    )
    worker_tls_client_cert: Path | None = Field(
        None,
        description="Mutual TLS: the certificate (PEM) this process presents to the workers; "
        "needs --worker-tls-client-key.",
    )
    worker_tls_client_key: Path | None = Field(
        None, description="Private key (PEM) of --worker-tls-client-cert."
    )
    token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_GATEWAY_TOKEN", "LORASTREAM_TOKEN"),
        description="Operate-scope bearer token required on the operator endpoints "
        "(/v1/adapters...) and shown adapter sources in /v1/models; without one they are open.",
    )
    token_file: Path | None = Field(
        None, description="File holding the operate token (first line) [instead of the variable]."
    )
    store_token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_GATEWAY_STORE_TOKEN", "LORASTREAM_TOKEN"),
        description="Bearer token the gateway sends to the store's operator calls "
        "[default: the gateway token].",
    )
    worker_token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_GATEWAY_WORKER_TOKEN", "LORASTREAM_TOKEN"),
        description="Operate token the gateway sends to the workers (load, unload) "
        "[default: the gateway token].",
    )
    api_keys: CliSuppress[Annotated[list[str], NoDecode]] = Field(
        default_factory=list,
        description="Inference API keys (comma-separated): with any, the OpenAI endpoints need "
        "'Authorization: Bearer <key>' with one of them (or the operate token).",
    )
    api_keys_file: Path | None = Field(
        None, description="File of inference API keys, one a line (# comments skipped)."
    )
    insecure_no_auth: bool = Field(
        False,
        description="Serve a non-loopback --host with no operate token (anyone reaching it may "
        "stage and delete adapters). Off: such a gateway refuses to start.",
    )
    resolve_interval_s: float = Field(
        5.0,
        ge=0,
        description="How often worker names are resolved again: a name with several addresses "
        "(a headless Service) is one worker per address. 0: each --worker is one worker, "
        "never resolved by the gateway.",
    )
    poll_interval_s: float = Field(
        0.5, gt=0, description="How often each worker's health, adapters and load are polled."
    )
    health_timeout_s: float = Field(1.0, gt=0, description="Deadline of one health check.")
    rpc_timeout_s: float = Field(
        10.0, gt=0, description="Deadline of unary worker and store calls (list, stats, unload)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Deadline of one generation, queueing included (then 504)."
    )
    load_timeout_s: float = Field(
        600.0, gt=0, description="Deadline of pushing an adapter into a worker (/load)."
    )
    preload_timeout_s: float = Field(
        3600.0, gt=0, description="Deadline of a preload through the store (POST /v1/adapters)."
    )
    max_requests_per_worker: int = Field(
        256,
        gt=0,
        description="Queue depth (waiting + running) at which a worker takes no more requests; "
        "when every healthy worker is there, requests get 429.",
    )
    spill_threshold: int = Field(
        2,
        ge=0,
        description="How many requests deeper than the least loaded worker's queue the preferred "
        "worker (adapter resident, or its hash choice) may be before a request goes elsewhere "
        "(at least; see --spill-fraction).",
    )
    spill_fraction: float = Field(
        0.25,
        ge=0,
        description="Once workers are busy, the preferred worker may be this fraction of the "
        "mean queue deeper than the least loaded one (when that exceeds --spill-threshold); "
        "0: the threshold alone.",
    )
    routing: Literal["affinity", "random"] = Field(
        "affinity",
        description="Routing policy: 'affinity' sends a request to a worker holding its adapter "
        "(device, then host memory), else to the adapter's rendezvous-hash home, within the "
        "load bound (--spill-threshold); 'random' picks uniformly among healthy workers under "
        "--max-requests-per-worker (a baseline for comparison; docs/gateway.md).",
    )
    prefix_affinity_entries: int = Field(
        32768,
        ge=0,
        description="Size of the prefix-affinity table (policy 'affinity'): a request goes to the "
        "worker that last served its prompt's longest known prefix for its model, whose prefix "
        "cache likely holds it, while that worker is within the load bound; each request adds "
        "up to 1 + log2(its 64-character chunks) entries, the least recently used are dropped "
        "first. 0: off (residency and load alone decide).",
    )
    routing_hint_ttl_s: float = Field(
        3.0,
        gt=0,
        description="How long a routing decision counts as 'the adapter is loading there' "
        "before a poll confirms it.",
    )
    max_body_bytes: int = Field(
        8 << 20, gt=0, description="Largest request body accepted (then 413)."
    )
    drain_seconds: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM/SIGINT: /health turns 503 and new requests get 503 at once; "
        "generations in flight get this long to finish, then each open stream ends with a "
        "shutting_down error event and [DONE]. Keep it below the orchestrator's grace period "
        "(terminationGracePeriodSeconds, stop_grace_period).",
    )

    metrics_adapter_labels: int = Field(
        20,
        ge=0,
        description="Per-model series (TTFT, ITL, latency, tokens, requests) for the N busiest "
        "models by name (counted with bounded memory, recent traffic weighing more); every other "
        "model's requests count under model=\"other\". 0: all under \"other\". "
        "docs/metrics.md.",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _split_workers(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(
                        f"expected a JSON list or comma-separated HOST:PORT targets ({exc})"
                    ) from None
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("workers")
    @classmethod
    def _unique_workers(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"workers must be distinct, got {value}")
        for target in value:
            host, sep, port = target.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker {target!r} is not HOST:PORT")
        return value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_api_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @model_validator(mode="after")
    def _tokens_from_files(self) -> GatewaySettings:
        """``token`` and ``api_keys`` from their files when the variables leave them unset."""
        try:
            if not self.token and self.token_file is not None:
                self.token = read_token_file(self.token_file, "token_file")
            if self.api_keys_file is not None:
                self.api_keys = [
                    *self.api_keys, *read_token_list_file(self.api_keys_file, "api_keys_file")
                ]
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        return self

    @property
    def effective_worker_token(self) -> str | None:
        """The token sent to the workers: its own, else the gateway's."""
        return self.worker_token or self.token

    @property
    def effective_store_token(self) -> str | None:
        """The token sent to the store: its own, else the gateway's."""
        return self.store_token or self.token
