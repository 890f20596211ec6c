"""The ``serve`` flags of the store, the worker and the gateway are generated from their settings
classes: one declaration per setting, flags over variables over defaults, a refused value is one
line (exit 2), and the docs' configuration tables match the fields."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
import typer
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from typer.testing import CliRunner

from lorastream.cli.main import app
from lorastream.cli.settings_flags import env_names, load_settings, setting_flags
from lorastream.gateway.config import GatewaySettings
from lorastream.store.config import StoreSettings
from lorastream.worker.service.config import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Service:
    name: str  # the CLI group: lorastream NAME serve
    settings: type[BaseSettings]
    serve: str  # what `serve` hands the settings to (stubbed here)
    doc: str

    @property
    def command(self) -> click.Command:
        group = typer.main.get_command(app)
        return group.commands[self.name].commands["serve"]  # type: ignore[attr-defined]  # a click Group here; typed Command


SERVICES = [
    Service("store", StoreSettings, "lorastream.store.server.serve", "docs/store.md"),
    Service("worker", WorkerSettings, "lorastream.worker.service.server.serve", "docs/worker.md"),
    Service("gateway", GatewaySettings, "lorastream.gateway.server.serve", "docs/gateway.md"),
]
BY_NAME = {service.name: service for service in SERVICES}
IDS = [service.name for service in SERVICES]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No setting comes from the test runner's environment (tests/conftest.py sets one)."""
    for name in list(os.environ):
        if name.startswith(("LORASTREAM_", "HF_")) or name == "AWS_ENDPOINT_URL":
            monkeypatch.delenv(name)


def serve_with(
    service: Service, args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Any:
    """The settings ``lorastream SERVICE serve ARGS`` starts with in ``env``."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    captured: list[Any] = []
    monkeypatch.setattr(service.serve, captured.append)
    result = CliRunner().invoke(app, [service.name, "serve", *args])
    assert result.exit_code == 0, result.output
    (settings,) = captured
    return settings


# -- one declaration ------------------------------------------------------------------------------
@pytest.mark.parametrize("service", SERVICES, ids=IDS)
def test_no_option_restates_a_default_and_every_field_is_a_flag_or_suppressed(
    service: Service,
) -> None:
    options = {param.name: param for param in service.command.params}
    flagged = {flag.field for flag in setting_flags(service.settings)}
    suppressed = set(service.settings.model_fields) - flagged
    assert suppressed <= {"token", "read_token", "store_token", "worker_token", "api_keys",
                          "hf_token", "stream_chunk_delay_s"}
    for flag in setting_flags(service.settings):
        option = options[flag.field]
        assert option.default is None, f"{flag.flag} restates a default"
        assert flag.flag in option.opts
    assert set(options) - flagged == {"log_level"}


@pytest.mark.parametrize("service", SERVICES, ids=IDS)
def test_help_shows_each_fields_description_variables_and_default(service: Service) -> None:
    result = CliRunner().invoke(app, [service.name, "serve", "--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for flag in setting_flags(service.settings):
        default = "" if flag.default is None else f"; default: {flag.default}"
        assert flag.usage in text
        description = " ".join(flag.description.split())
        assert f"{description} [env var: {', '.join(flag.env)}{default}]" in text


# -- precedence: flag > variable > default --------------------------------------------------------
@pytest.mark.parametrize(
    ("service", "field", "flag", "variable", "default", "from_env", "from_flag"),
    [
        ("store", "port", "--port", "LORASTREAM_STORE_PORT", 50051, 1234, 2345),
        ("store", "token_file", "--token-file", "LORASTREAM_STORE_TOKEN_FILE", None,
         Path("/env/token"), Path("/flag/token")),
        ("worker", "max_loras", "--max-loras", "LORASTREAM_WORKER_MAX_LORAS", 8, 4, 2),
        ("worker", "fetch_process", "--fetch-process", "LORASTREAM_WORKER_FETCH_PROCESS",
         True, False, True),
        ("worker", "layered_admission", "--layered-admission",
         "LORASTREAM_WORKER_LAYERED_ADMISSION", False, True, False),
        ("store", "insecure_no_auth", "--insecure-no-auth", "LORASTREAM_STORE_INSECURE_NO_AUTH",
         False, False, True),
        ("worker", "store", "--store", "LORASTREAM_STORE", None, "env:1", "flag:2"),
        ("worker", "dtype", "--dtype", "LORASTREAM_WORKER_DTYPE", "auto", "float16", "float32"),
        ("gateway", "poll_interval_s", "--poll-interval", "LORASTREAM_GATEWAY_POLL_INTERVAL_S",
         0.5, 2.0, 0.25),
        ("gateway", "workers", "--worker", "LORASTREAM_GATEWAY_WORKERS",
         [], ["e:1", "e:2"], ["f:1"]),
    ],
)
@pytest.mark.parametrize("given", ["nothing", "variable", "variable-and-flag"])
def test_a_flag_wins_over_its_variable_which_wins_over_the_default(
    service: str, field: str, flag: str, variable: str, default: Any, from_env: Any,
    from_flag: Any, given: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def text(value: Any) -> list[str]:
        if isinstance(value, bool):  # what a variable takes
            return ["true" if value else "false"]
        return [str(v) for v in value] if isinstance(value, list) else [str(value)]

    if given == "nothing" and field == "workers":  # the default, none, is refused at start
        monkeypatch.delenv(variable, raising=False)
        result = CliRunner().invoke(app, ["gateway", "serve"])
        assert result.exit_code == 1 and "needs at least one worker" in result.output
        assert default == GatewaySettings.model_fields[field].get_default(call_default_factory=True)
        return
    args = ["--worker", "w:1"] if service == "gateway" and field != "workers" else []
    env = {variable: ",".join(text(from_env))} if given != "nothing" else {}
    if given == "variable-and-flag" and isinstance(from_flag, bool):  # a switch: no value
        args.append(flag if from_flag else "--no-" + flag.removeprefix("--"))
    elif given == "variable-and-flag":
        args += [arg for value in text(from_flag) for arg in (flag, value)]
    expected = {"nothing": default, "variable": from_env, "variable-and-flag": from_flag}[given]
    settings = serve_with(BY_NAME[service], args, env, monkeypatch)
    assert getattr(settings, field) == expected


@pytest.mark.parametrize(
    ("service", "variable", "field"),
    [("worker", "LORASTREAM_WORKER_STORE_TOKEN", "store_token"),
     ("worker", "LORASTREAM_WORKER_TOKEN", "token"),
     ("store", "LORASTREAM_STORE_TOKEN", "token"),
     ("store", "LORASTREAM_STORE_READ_TOKEN", "read_token"),
     ("gateway", "LORASTREAM_GATEWAY_TOKEN", "token"),
     ("gateway", "LORASTREAM_GATEWAY_WORKER_TOKEN", "worker_token"),
     ("worker", "HF_TOKEN", "hf_token"),
     ("gateway", "LORASTREAM_GATEWAY_STORE_TOKEN", "store_token"),
     ("store", "LORASTREAM_STORE_HF_TOKEN", "hf_token")],
)
def test_tokens_without_a_flag_come_from_the_environment_only(
    service: str, variable: str, field: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = ["--worker", "w:1"] if service == "gateway" else []
    settings = serve_with(BY_NAME[service], args, {variable: "secret"}, monkeypatch)
    assert getattr(settings, field) == "secret"
    flag = "--" + field.replace("_", "-")
    result = CliRunner().invoke(app, [service, "serve", *args, flag, "secret"])
    assert result.exit_code == 2 and "No such option" in result.output


# -- refused values -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["worker", "serve", "--max-loras", "0"],
         "--max-loras 0: Input should be greater than 0"),
        (["worker", "serve", "--max-loras", "eight"],
         "--max-loras eight: Input should be a valid integer"),
        (["worker", "serve", "--dtype", "int8"],
         "--dtype int8: Input should be 'auto', 'float32', 'float16' or 'bfloat16'"),
        (["store", "serve", "--chunk-bytes", str(8 << 20)],
         f"--chunk-bytes {8 << 20}: Input should be less than or equal to {4 << 20}"),
        (["store", "serve", "--cache-dir", "/tmp/x", "--port", "[red]x"],
         "--port '[red]x': Input should be a valid integer"),
        (["gateway", "serve", "--worker", "a:1", "--worker", "a:1"],
         "--worker a:1 --worker a:1: workers must be distinct"),
        (["gateway", "serve", "--worker", "nohost"],
         "--worker nohost: worker 'nohost' is not HOST:PORT"),
        (["store", "serve", "--log-level", "verbose"],
         "--log-level verbose: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
        (["gateway", "serve", "--log-level", "loud", "--worker", "w:1"],
         "--log-level loud: expected one of"),
    ],
)
def test_a_refused_flag_is_one_line_naming_it_its_value_and_what_was_expected(
    args: list[str], expected: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(BY_NAME[args[0]].serve, lambda settings: pytest.fail("it started"))
    result = CliRunner().invoke(app, args, terminal_width=80)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), result.output


def bool_options(command: click.Command) -> list[Any]:
    """The switches of ``command`` (typer's own option class, not click's)."""
    return [p for p in command.params if getattr(p, "is_flag", False)]


@pytest.mark.parametrize("service", SERVICES, ids=IDS)
def test_every_boolean_setting_is_a_switch_with_its_negation(service: Service) -> None:
    """``--x`` / ``--no-x`` with no value, as typer and vLLM's CLI write them (and as `up`
    does); before, the generated ones took ``on|off`` (``store serve --insecure-no-auth on``)."""
    switches = {flag.field: flag for flag in setting_flags(service.settings) if flag.switch}
    assert switches, "no boolean setting to check"
    options = {option.name: option for option in bool_options(service.command)}
    assert set(options) == set(switches)
    for name, flag in switches.items():
        option = options[name]
        assert option.is_flag and (option.opts, option.secondary_opts) == ([flag.flag], [flag.off])
    result = CliRunner().invoke(app, [service.name, "serve", *(["--worker", "w:1"] * (
        service.name == "gateway")), next(iter(switches.values())).flag, "off"])
    assert result.exit_code == 2 and "unexpected extra argument" in result.output


def test_up_takes_its_boolean_options_as_switches_too() -> None:
    up = typer.main.get_command(app).commands["up"]  # type: ignore[attr-defined]  # a click Group here; typed Command
    options = bool_options(up)
    assert {o.name for o in options} >= {"insecure_no_auth", "tls", "samples"}
    for option in options:
        assert option.is_flag and option.secondary_opts == ["--no-" + option.opts[0][2:]]


def test_up_refuses_a_bad_log_level_in_one_line_before_starting_anything() -> None:
    result = CliRunner().invoke(app, ["up", "--log-level", "verbose"], terminal_width=80)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: --log-level verbose: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL")


@pytest.mark.parametrize(
    ("service", "variable", "value", "expected"),
    [
        ("worker", "LORASTREAM_WORKER_MAX_LORAS", "eight",
         "LORASTREAM_WORKER_MAX_LORAS=eight: Input should be a valid integer"),
        ("worker", "LORASTREAM_WORKER_LORA_BACKEND", "cuda",
         "LORASTREAM_WORKER_LORA_BACKEND=cuda: Input should be 'torch' or 'triton'"),
        ("worker", "LORASTREAM_WORKER_FETCH_PROCESS", "maybe",
         "LORASTREAM_WORKER_FETCH_PROCESS=maybe: Input should be true or false"),
        ("store", "LORASTREAM_STORE_PORT", "5 0051",
         "LORASTREAM_STORE_PORT='5 0051': Input should be a valid integer"),
        ("gateway", "LORASTREAM_GATEWAY_WORKERS", "[w:1",
         "LORASTREAM_GATEWAY_WORKERS='[w:1': expected a JSON list or comma-separated HOST:PORT"),
    ],
)
def test_a_refused_variable_is_one_line_naming_it_its_value_and_what_was_expected(
    service: str, variable: str, value: str, expected: str,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTREAM_")}
    args = ["--worker", "w:1"] if service == "gateway" and "WORKERS" not in variable else []
    done = subprocess.run(
        [sys.executable, "-m", "lorastream.cli.main", service, "serve", *args],
        env=env | {variable: value, "COLUMNS": "60"}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), done.stderr
    assert done.stdout == ""


# -- the docs --------------------------------------------------------------------------------------
def configuration_rows(doc: str) -> list[list[str]]:
    """The rows of the ``| flag | variable | default | meaning |`` table under ## Configuration."""
    section = (ROOT / doc).read_text().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    assert lines and lines[0] == "| flag | variable | default | meaning |", f"{doc}: no table"
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@pytest.mark.parametrize("service", SERVICES, ids=IDS)
def test_the_configuration_table_lists_every_field_with_its_flag_variables_and_default(
    service: Service,
) -> None:
    flags = {flag.field: flag for flag in setting_flags(service.settings)}
    rows = configuration_rows(service.doc)
    by_variables = {tuple(backticked(row[1])): row for row in rows if row[1] != "—"}
    for name in service.settings.model_fields:
        variables = env_names(service.settings, name)
        assert variables in by_variables, f"{service.doc}: no row for {' or '.join(variables)}"
        documented_flag, _, default, _ = by_variables[variables]
        flag = flags.get(name)
        assert backticked(documented_flag)[:1] == ([flag.flag] if flag else []), (
            f"{service.doc}: {variables[0]} is documented with the flag {documented_flag}"
        )
        if flag and flag.switch:
            assert backticked(documented_flag) == [flag.flag, flag.off], (
                f"{service.doc}: the switch {flag.flag} is documented as {documented_flag}"
            )
        if flag and flag.default is not None:
            assert backticked(default)[:1] == [flag.default.split(" (")[0]], (
                f"{service.doc}: {flag.flag} is documented with the default {default}, "
                f"not {flag.default}"
            )
    offered = {opt for param in service.command.params
               for opt in (*param.opts, *param.secondary_opts)}
    for documented_flag, *_ in rows:
        for flag_name in backticked(documented_flag):
            assert flag_name in offered, f"{service.doc}: {flag_name} is not a flag"
    assert len(rows) == len(service.settings.model_fields) + 1  # + --log-level


def test_every_documented_or_deployed_variable_is_a_setting() -> None:
    known = {variable for service in SERVICES for name in service.settings.model_fields
             for variable in env_names(service.settings, name)}
    files = [ROOT / "README.md", ROOT / "docker-compose.yml",
             *(ROOT / service.doc for service in SERVICES),
             *sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))]
    for path in files:
        text = path.read_text()
        for variable in re.findall(r"LORASTREAM_(?:STORE|WORKER|GATEWAY)_[A-Z0-9_]+", text):
            assert variable in known, f"{path.relative_to(ROOT)} names {variable}, no setting"


def test_a_variable_that_is_not_json_for_a_list_field_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    class ListSettings(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="LORASTREAM_TEST_")
        sizes: list[int] = Field(default_factory=list)

    monkeypatch.setenv("LORASTREAM_TEST_SIZES", "[1,")
    with pytest.raises(typer.Exit) as exit_info:
        load_settings(ListSettings, {})
    assert exit_info.value.exit_code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: error parsing value for field "sizes"')
