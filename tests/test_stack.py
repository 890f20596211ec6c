"""`lorastream up` end to end: store, worker and gateway as real processes, an adapter registered
at start, completions through the CLI client and through the gateway with the official openai
client, then a clean stop on SIGINT."""

from __future__ import annotations

import json
import signal
import socket
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
from lorastream.stack.launcher import (
    SAMPLE_QUESTION,
    Stack,
    StackConfig,
    examples,
    parse_adapter_specs,
    stack_adapters,
)
from tests.support.models import make_peft_adapter, make_tiny_checkpoint


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_up_starts_store_worker_and_gateway_serves_a_registered_adapter_and_stops_cleanly(
    tmp_path: Path,
) -> None:
    model = make_tiny_checkpoint(tmp_path / "model")
    adapter = make_peft_adapter(model, tmp_path / "adapter", rank=4, targets=["q_proj", "v_proj"])
    store_port, worker_port, gateway_port = _free_ports(3)
    env_home = {"HOME": str(tmp_path / "home")}  # caches under tmp_path, not the user's
    import os

    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastream.cli.main", "up", "--model", str(model),
         "--adapter", f"demo={adapter}", "--store-port", str(store_port),
         "--worker-port", str(worker_port), "--port", str(gateway_port),
         "--log-level", "WARNING"],
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
        assert any("--model demo" in line for line in lines), "".join(lines)
        result = CliRunner().invoke(app, [
            "complete", "--worker", f"localhost:{worker_port}", "--model", "demo",
            "--prompt", "Hello", "--max-tokens", "5", "--json",
        ])
        assert result.exit_code == 0, result.output
        assert len(json.loads(result.output.strip().splitlines()[-1])["token_ids"]) >= 1

        gateway = f"http://localhost:{gateway_port}"
        assert any(f"curl {gateway}/v1/chat/completions" in line for line in lines)
        assert httpx.get(f"{gateway}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
        assert {m.id for m in client.models.list()} == {str(model), "demo"}
        reply = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=5
        )
        assert 1 <= reply.usage.completion_tokens <= 5
        client.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    result = CliRunner().invoke(app, ["adapters", "ls", "--store", f"localhost:{store_port}"])
    assert result.exit_code == 1  # the store is gone too
    with pytest.raises(httpx.ConnectError):  # and the gateway
        httpx.get(f"http://localhost:{gateway_port}/health")


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
    assert text.count(f'"model": "shout", "messages": [{{"role": "user", "content": '
                      f'"{SAMPLE_QUESTION}"') == 1
