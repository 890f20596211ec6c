"""`lorastream up` end to end: store, worker and gateway as real processes, an adapter registered
at start, completions through the CLI client and through the gateway with the official openai
client, then a clean stop on SIGINT."""

from __future__ import annotations

import json
import re
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

import lorastream
from lorastream.cli.main import app
from lorastream.core.errors import InvalidArgument
from lorastream.stack.examples import examples
from lorastream.stack.launcher import (
    SAMPLE_QUESTION,
    Stack,
    StackConfig,
    parse_adapter_specs,
    stack_adapters,
)
from lorastream.store.config import StoreSettings
from lorastream.worker.service.config import WorkerSettings
from tests.support.models import make_peft_adapter, make_tiny_checkpoint
from tests.support.ports import free_ports


def printed_commands(lines: list[str]) -> list[str]:
    """The shell commands in `lorastream up`'s output: indented lines, and heredoc blocks."""
    commands: list[str] = []
    heredoc: list[str] | None = None
    for line in (line.rstrip("\n") for line in lines):
        if heredoc is not None:
            heredoc.append(line)
            if line == "EOF":
                commands.append("\n".join(heredoc))
                heredoc = None
        elif line.endswith("<<'EOF'"):
            heredoc = [line]
        elif line.startswith("  "):
            commands.append(line.strip())
    return commands


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name{labels}`` in a Prometheus exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_up_starts_store_worker_and_gateway_serves_a_registered_adapter_and_stops_cleanly(
    tmp_path: Path, tls: bool
) -> None:
    """With ``--tls``: HTTPS at the gateway, mutual TLS gateway -> worker -> store, and every
    printed example trusting the throwaway CA."""
    model = make_tiny_checkpoint(tmp_path / "model")
    adapter = make_peft_adapter(model, tmp_path / "adapter", rank=4, targets=["q_proj", "v_proj"])
    extra = make_peft_adapter(model, tmp_path / "extra-root" / "extra", rank=4, targets=["q_proj"])
    store_port, worker_port, gateway_port, metrics_port = free_ports(4)
    env_home = {"HOME": str(tmp_path / "home")}  # caches under tmp_path, not the user's
    (tmp_path / "home").mkdir()
    import os

    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastream.cli.main", "up", "--model", str(model),
         "--adapter", f"demo={adapter}", "--store-port", str(store_port),
         "--worker-port", str(worker_port), "--port", str(gateway_port),
         "--metrics-port", str(metrics_port), "--allowed-local-root", str(extra.parent),
         "--log-level", "WARNING", *(["--tls"] if tls else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **env_home},
    )
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode()
            if not line and proc.poll() is not None:
                pytest.fail("lorastream up exited early:\n" + "".join(lines))
            lines.append(line)
            if line.startswith("Ctrl-C stops everything"):
                break
        assert any("--model demo" in line for line in lines), (len(lines), lines[:30])
        for command in printed_commands(lines):  # each as printed, in a new shell
            ran = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path / "home", capture_output=True, text=True,
                env={"PATH": "/usr/bin:/bin", **env_home}, timeout=120,
            )
            assert ran.returncode == 0 and '"error"' not in ran.stdout, (command, ran)
        found = re.search(r" --tls-ca (\S+) --tls-client-cert (\S+) --tls-client-key (\S+)",
                          "".join(lines))
        assert (found is not None) == tls, "".join(lines)
        ca, tls_flags = (Path(found[1]), found[0].split()) if found else (None, [])
        result = CliRunner().invoke(app, [
            "complete", "--worker", f"localhost:{worker_port}", "--model", "demo",
            "--prompt", "Hello", "--max-tokens", "5", "--json", *tls_flags,
        ])
        assert result.exit_code == 0, result.output
        assert len(json.loads(result.output.strip().splitlines()[-1])["token_ids"]) >= 1

        gateway = f"{'https' if tls else 'http'}://localhost:{gateway_port}"
        curl = f"curl --cacert {ca}" if tls else "curl"
        assert any(f"{curl} {gateway}/v1/chat/completions" in line for line in lines)
        verify = ssl.create_default_context(cafile=str(ca)) if tls else True
        assert httpx.get(f"{gateway}/health", verify=verify).status_code == 200
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=verify))
        # the printed operator examples registered my-adapter, a copy of a sample: trained for
        # the default model, it fits not this one, and /v1/models lists only what fits
        assert {m.id for m in client.models.list()} == {str(model), "demo"}
        reply = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=5
        )
        assert 1 <= reply.usage.completion_tokens <= 5
        client.close()
        # secure by default: the printed operate token, in a 0600 file; anonymous callers refused
        told = re.search(r"Operator token \(shown once; also in (\S+), mode 0600\): (\S+)",
                         "".join(lines))
        assert told is not None, "".join(lines)
        token_file, token = Path(told[1]), told[2]
        assert token_file.read_text().strip() == token
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert httpx.get(f"{gateway}/v1/adapters", verify=verify).status_code == 401
        operator = {"Authorization": f"Bearer {token}"}
        stored = httpx.get(f"{gateway}/v1/adapters", verify=verify, headers=operator)
        assert {a["name"] for a in stored.json()["data"]} == {"demo", "my-adapter"}
        # --allowed-local-root reaches the store: vLLM's load_lora_adapter stages a path under
        # it, and refuses one elsewhere saying which flag allows it
        for name, path, status in [("extra", extra, 200),
                                   ("elsewhere", tmp_path / "elsewhere" / "a", 400)]:
            loaded = httpx.post(f"{gateway}/v1/load_lora_adapter", verify=verify,
                                headers=operator, json={"lora_name": name, "lora_path": str(path)},
                                timeout=60)
            assert loaded.status_code == status, loaded.text
        assert "lorastream up --allowed-local-root DIR" in loaded.text
        anonymous = CliRunner().invoke(
            app, ["adapters", "ls", "--store", f"localhost:{store_port}", *tls_flags]
        )
        assert anonymous.exit_code == 1 and "Unauthenticated" in anonymous.output
        # metrics on by default: every part's /metrics answers with its own series
        store_metrics = httpx.get(f"http://localhost:{metrics_port}/metrics").text
        worker_metrics = httpx.get(f"http://localhost:{metrics_port + 1}/metrics").text
        gateway_metrics = httpx.get(f"{gateway}/metrics", verify=verify).text
        assert _sample(store_metrics, "lorastream_store_adapters_staged") >= 2  # demo, my-adapter
        assert _sample(store_metrics, "lorastream_store_streams_total") >= 1
        worker_lookups = sum(_sample(worker_metrics, f"lorastream_worker_adapter_{kind}_total",
                                     tier="device") for kind in ("hits", "misses"))
        assert worker_lookups >= 2  # the CLI's and the openai client's requests for demo
        assert _sample(gateway_metrics, "lorastream_gateway_requests_total",
                       endpoint="/v1/chat/completions", status="200") >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    result = CliRunner().invoke(app, ["adapters", "ls", "--store", f"localhost:{store_port}"])
    assert result.exit_code == 1  # the store is gone too
    with pytest.raises(httpx.ConnectError):  # and the gateway
        httpx.get(f"{gateway}/health", verify=verify)
    assert ca is None or not ca.parent.exists()  # and the throwaway CA with its keys


@pytest.mark.parametrize("spec", ["noequals", "=s3://b/a", "name="])
def test_malformed_adapter_specs_are_refused(spec: str) -> None:
    with pytest.raises(InvalidArgument, match="NAME=URI"):
        parse_adapter_specs([spec])


def test_with_no_adapters_the_default_model_gets_the_sample_adapters_and_no_other_model() -> None:
    samples = stack_adapters("default", [], samples=True)
    assert set(samples) == {"shout", "french"}
    for path in samples.values():  # shipped inside the package, so `pip install` has them
        assert (Path(path) / "adapter_model.safetensors").is_file()
        assert Path(path).is_relative_to(Path(lorastream.__file__).parent)
    assert stack_adapters("default", [], samples=False) == {}
    assert stack_adapters("/models/other-llama", [], samples=True) == {}
    assert stack_adapters("default", ["demo=s3://b/demo"], samples=True) == {
        "demo": "s3://b/demo"
    }


def test_the_examples_show_each_sample_adapter_on_the_same_question() -> None:
    stack = Stack(StackConfig(adapters=stack_adapters("default", [], samples=True)))
    text = examples(stack, "default")
    assert "shout (answers in UPPER CASE)" in text and "french (answers in French)" in text
    for name in ("shout", "french", "default"):
        assert f"--model {name} --chat --prompt '{SAMPLE_QUESTION}'" in text
        assert text.count(f'"model": "{name}", "messages": [{{"role": "user", "content": '
                          f'"{SAMPLE_QUESTION}"') == 1


def test_the_examples_are_greedy_and_name_only_absolute_paths() -> None:
    stack = Stack(StackConfig(adapters=stack_adapters("default", [], samples=True)))
    commands = printed_commands(examples(stack, "default").splitlines())
    requests = [c for c in commands
                if c.startswith("curl") and ('"prompt"' in c or '"messages"' in c)]
    assert len(requests) == 4  # three chat questions and one streamed completion
    assert all(re.search(r'"temperature": 0[,}]', c) for c in requests), requests
    (client,) = [c for c in commands if "OpenAI(" in c]
    assert "temperature=0," in client
    preload = next(c for c in commands if " adapters preload " in c).split()
    assert Path(preload[preload.index("preload") + 1]).is_absolute()


@pytest.mark.parametrize("spec", ["demo=./adapters/demo", "demo=adapters/demo"])
def test_a_relative_adapter_path_is_registered_as_an_absolute_one(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_adapter_specs([spec]) == {"demo": str(tmp_path / "adapters" / "demo")}


def test_up_help_offers_another_allowed_local_root() -> None:
    result = CliRunner().invoke(app, ["up", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "--allowed-local-root DIR Another directory the store may stage local adapters" in text
    assert "POST /v1/load_lora_adapter" in text


@pytest.mark.parametrize("role", ["store", "worker", "gateway", "store metrics",
                                  "worker 0 metrics"])
def test_up_refuses_a_port_in_use_before_starting_anything(role: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        roles = ("store", "worker", "gateway", "store metrics")
        others = iter(free_ports(len(roles)))
        ports = {name: port if name == role else next(others) for name in roles}
        if role == "worker 0 metrics":  # worker i serves its metrics on --metrics-port + 1 + i
            ports["store metrics"] = port - 1
        stack = Stack(StackConfig(store_port=ports["store"], worker_port=ports["worker"],
                                  gateway_port=ports["gateway"],
                                  metrics_port=ports["store metrics"]))
        with pytest.raises(InvalidArgument, match=rf"{role}\b.* port {port} is in use"):
            stack.start()
    assert stack.processes == []


def test_the_stack_serves_metrics_where_the_parts_serve_them_by_default() -> None:
    """`lorastream up`'s metrics ports are the settings' defaults: the store's, then worker i's
    at +1+i (a worker started alone serves on the first)."""
    stack = Stack(StackConfig(workers=2))
    store, worker = (settings.model_fields["metrics_port"].default  # tests/conftest.py sets 0
                     for settings in (StoreSettings, WorkerSettings))
    assert (store, worker) == (9451, 9452)
    assert stack.metrics_urls == {
        "store": f"http://localhost:{store}/metrics",
        "worker 0": f"http://localhost:{worker}/metrics",
        "worker 1": f"http://localhost:{worker + 1}/metrics",
        "gateway": "http://localhost:8000/metrics",
    }
