"""HTTP gateway configuration: the one place the gateway reads its environment.

Every field is an environment variable ``LORASTREAM_GATEWAY_<FIELD>`` and, unless marked
``CliSuppress`` (tokens, kept out of process listings), a ``lorastream gateway serve`` flag
generated from it (lorastream/cli/settings_flags.py: name, default and help come from here).
``LORASTREAM_GATEWAY_WORKERS`` takes a comma-separated list (``host:50052,host:50053``) or a JSON
list; the flag is repeated (``--worker host:50052 --worker host:50053``).
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, CliSuppress, NoDecode, SettingsConfigDict


class GatewaySettings(BaseSettings):
    """Settings of one gateway process."""

    model_config = SettingsConfigDict(
        env_prefix="LORASTREAM_GATEWAY_", extra="ignore", populate_by_name=True
    )

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 to serve other hosts.")
    port: int = Field(8000, ge=0, description="HTTP port; 0 picks a free one.")
    store: str = Field(
        "localhost:50051",
        validation_alias=AliasChoices("LORASTREAM_GATEWAY_STORE", "LORASTREAM_STORE"),
        description="Adapter store HOST:PORT (the catalogue of /v1/models and operator calls).",
    )
    workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="GPU worker HOST:PORT targets (at least one)."
    )
    token: str | None = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_GATEWAY_TOKEN", "LORASTREAM_TOKEN"),
        description="Bearer token required on the operator endpoints (/v1/adapters...); "
        "without one they are open.",
    )
    store_token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_GATEWAY_STORE_TOKEN", "LORASTREAM_TOKEN"),
        description="Bearer token the gateway sends to the store's operator calls "
        "[default: the gateway token].",
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
        8,
        ge=0,
        description="How much deeper than the least loaded worker's queue the preferred worker "
        "(adapter resident, or its hash choice) may be before a request goes elsewhere.",
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

    @property
    def effective_store_token(self) -> str | None:
        """The token sent to the store: its own, else the gateway's."""
        return self.store_token or self.token
