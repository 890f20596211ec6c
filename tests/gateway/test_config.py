"""Gateway settings from flags and the environment, and the ``lorastream gateway`` CLI."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.core.errors import InvalidArgument
from lorastream.gateway.app import create_app
from lorastream.gateway.config import GatewaySettings


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("w1:50052", ["w1:50052"]),
        ("w1:50052, w2:50052,", ["w1:50052", "w2:50052"]),
        ('["w1:50052", "w2:50053"]', ["w1:50052", "w2:50053"]),
    ],
)
def test_workers_come_from_a_comma_separated_or_json_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: list[str]
) -> None:
    monkeypatch.setenv("LORASTREAM_GATEWAY_WORKERS", value)
    assert GatewaySettings().workers == expected


@pytest.mark.parametrize(
    ("env", "token", "store_token"),
    [
        ({}, None, None),
        ({"LORASTREAM_TOKEN": "shared"}, "shared", "shared"),
        ({"LORASTREAM_GATEWAY_TOKEN": "gw", "LORASTREAM_TOKEN": "store"}, "gw", "store"),
        ({"LORASTREAM_GATEWAY_TOKEN": "gw"}, "gw", "gw"),
        ({"LORASTREAM_GATEWAY_TOKEN": "gw", "LORASTREAM_GATEWAY_STORE_TOKEN": "s"}, "gw", "s"),
    ],
)
def test_tokens_of_the_gateway_and_of_the_store_are_read_separately(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], token: str | None,
    store_token: str | None,
) -> None:
    for name in ("LORASTREAM_TOKEN", "LORASTREAM_GATEWAY_TOKEN", "LORASTREAM_GATEWAY_STORE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = GatewaySettings()
    assert (settings.token, settings.effective_store_token) == (token, store_token)


@pytest.mark.parametrize(
    "overrides",
    [{"workers": ["a:1", "a:1"]}, {"poll_interval_s": 0}, {"max_requests_per_worker": 0}],
)
def test_invalid_settings_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        GatewaySettings(**overrides)  # type: ignore[arg-type]  # overrides: the settings' own fields


def test_an_app_without_workers_is_refused_with_what_to_pass() -> None:
    with pytest.raises(InvalidArgument, match="--worker"):
        create_app(GatewaySettings(workers=[]))


def test_the_cli_documents_serve_and_refuses_to_start_without_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LORASTREAM_GATEWAY_WORKERS", raising=False)
    runner = CliRunner()
    help_text = runner.invoke(app, ["gateway", "serve", "--help"]).output
    for flag in ("--worker", "--store", "--token", "--port", "--host"):
        assert flag in help_text
    result = runner.invoke(app, ["gateway", "serve", "--port", "0"])
    assert result.exit_code == 1
    assert "--worker" in result.output
