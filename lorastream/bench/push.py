"""From a training loop's memory to the first token: push against write-to-S3-then-preload.

One store, one worker and moto's S3 server (its own process on loopback) serve both paths in the
same run. Each round makes two fresh synthetic adapters in memory (about 20 MB each on the
default model: rank 32, every linear projection, fp16; new random weights, so neither the store
nor the worker holds their content yet) and times, in turns (which path goes first alternates):

- **push**: ``push_state_dict`` (serialise, UploadAdapter, staged and acknowledged by the
  store), then one request for the adapter through the worker until its first token.
- **s3**: the same serialisation, boto3 ``put_object`` of ``adapter_model.safetensors`` and
  ``adapter_config.json``, ``PreloadAdapter`` of that prefix (download, validate, stage), then
  the same request.

Both clocks start with the state dict in memory and stop at the first streamed token; the
request pays the worker's fetch from the store and its load in both. One untimed warm-up round
comes first. Reported: p50s of the whole path and of its parts, every round's samples, and the
ratio of the p50s (S3 / push).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lorastream.bench.harness import PROMPTS, free_port, running, running_store, stop, warm_up
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.synthetic import ALL_LINEAR, adapter_nbytes, checkpoint_shape, synthetic_lora
from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.generation import SamplingParams
from lorastream.core.push import adapter_config_bytes, adapter_weights_bytes, push_state_dict
from lorastream.core.store_client import StoreClient
from lorastream.core.worker_client import WorkerClient
from lorastream.stack.launcher import wait_http_ok

BUCKET = "lorastream-push-bench"
PATHS = ("push", "s3")
# moto takes any credentials; these keep boto3 (here and in the store) off the machine's own.
DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass(frozen=True)
class PushConfig:
    model: str = "default"
    rank: int = 32  # with ALL_LINEAR in fp16: 19.5 MB on the default model
    targets: tuple[str, ...] = ALL_LINEAR
    repeats: int = 5  # timed rounds, after one untimed warm-up round
    seed: int = 0


@contextmanager
def moto_s3_server() -> Iterator[str]:
    """moto's S3 server in its own process on a free loopback port; yields its endpoint URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # one log line per request
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{endpoint}/moto-api/", process, timeout_s=60)
        yield endpoint
    finally:
        stop(process, grace_s=10)


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while inside (children spawned meanwhile inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client for ``endpoint`` (path-style, the dummy credentials)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session(
        aws_access_key_id=DUMMY_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=DUMMY_AWS["AWS_SECRET_ACCESS_KEY"],
        region_name=DUMMY_AWS["AWS_DEFAULT_REGION"],
    ).client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))


def first_token(worker: WorkerClient, name: str) -> float:
    """Send one request for adapter ``name``; the ``perf_counter`` time its first token came."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for event in worker.generate(name, PROMPTS[0], params, timeout=600):
        if event.token_ids:
            return time.perf_counter()
    raise RuntimeError(f"the worker streamed no token for adapter {name!r}")


def _via_push(store: StoreClient, worker: WorkerClient, name: str,
              tensors: dict[str, torch.Tensor], lora_config: dict[str, object]) -> dict[str, float]:
    start = time.perf_counter()
    push_state_dict(store, name, tensors, lora_config)
    staged = time.perf_counter()
    done = first_token(worker, name)
    return {"total_ms": done - start, "staged_ms": staged - start, "request_ms": done - staged}


def _via_s3(store: StoreClient, worker: WorkerClient, s3: Any, name: str,
            tensors: dict[str, torch.Tensor], lora_config: dict[str, object]) -> dict[str, float]:
    start = time.perf_counter()
    weights, config = adapter_weights_bytes(tensors), adapter_config_bytes(lora_config)
    s3.put_object(Bucket=BUCKET, Key=f"{name}/{WEIGHTS_FILE}", Body=weights)
    s3.put_object(Bucket=BUCKET, Key=f"{name}/{CONFIG_FILE}", Body=config)
    written = time.perf_counter()
    for _ in store.preload(f"s3://{BUCKET}/{name}", name):
        pass
    staged = time.perf_counter()
    done = first_token(worker, name)
    return {"total_ms": done - start, "put_ms": written - start, "preload_ms": staged - written,
            "staged_ms": staged - start, "request_ms": done - staged}


def _p50s(rounds: list[dict[str, float]]) -> dict[str, object]:
    """Per measured part: its p50 in ms and every round's value (ms, in round order)."""
    keys = rounds[0] if rounds else {}
    return {
        key: {"p50": round(statistics.median(r[key] for r in rounds) * 1000, 1),
              "samples": [round(r[key] * 1000, 1) for r in rounds]}
        for key in keys
    }


def run_push_bench(config: PushConfig) -> dict[str, object]:
    load_before = os.getloadavg()[0]
    shape = checkpoint_shape(config.model)
    adapter_bytes = adapter_nbytes(shape, config.rank, config.targets, 2)
    store_port, worker_port = free_port(), free_port()
    store_target, worker_target = f"127.0.0.1:{store_port}", f"127.0.0.1:{worker_port}"
    worker_args = [
        "worker", "serve", "--model", config.model, "--served-model-name", "base",
        "--port", str(worker_port), "--store", store_target,
        "--max-lora-rank", str(config.rank),
    ]
    samples: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    with tempfile.TemporaryDirectory(prefix="lorastream-push-") as tmp, ExitStack() as stack:
        s3_url = stack.enter_context(moto_s3_server())
        s3 = s3_client(s3_url)
        s3.create_bucket(Bucket=BUCKET)
        with _environment({**DUMMY_AWS, "LORASTREAM_STORE_S3_ENDPOINT_URL": s3_url}):
            stack.enter_context(running_store(Path(tmp) / "store", store_port))
        stack.enter_context(running(worker_args, worker_port))
        store = stack.enter_context(StoreClient(store_target))
        worker = stack.enter_context(WorkerClient(worker_target))
        warm_up(worker_target)
        for index in range(config.repeats + 1):  # round 0 warms up, untimed
            order = PATHS if index % 2 == 0 else PATHS[::-1]
            for k, path in enumerate(order):
                tensors, lora_config = synthetic_lora(
                    shape, rank=config.rank, targets=config.targets, dtype=torch.float16,
                    seed=config.seed * 1_000_003 + 2 * index + k,
                )
                name = f"{path}-{index}"
                if path == "push":
                    timing = _via_push(store, worker, name, tensors, lora_config)
                else:
                    timing = _via_s3(store, worker, s3, name, tensors, lora_config)
                if index:
                    samples[path].append(timing)
    push, via_s3 = _p50s(samples["push"]), _p50s(samples["s3"])
    push_p50 = push["total_ms"]["p50"] if push else None  # type: ignore[index]  # _p50s values are dicts for these keys
    s3_p50 = via_s3["total_ms"]["p50"] if via_s3 else None  # type: ignore[index]  # _p50s values are dicts for these keys
    return {
        "benchmark": "push",
        "command": command_line(),
        "machine": machine_info(),
        "load_average_1m_at_start": round(load_before, 2),
        "config": asdict(config),
        "adapter_mb": round(adapter_bytes / 1e6, 2),
        "rounds": config.repeats,
        "push": push,
        "s3": via_s3,
        "s3_over_push": round(s3_p50 / push_p50, 2) if push_p50 and s3_p50 else None,
        "goal": "s3_over_push >= 1.0",
    }
