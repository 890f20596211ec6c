"""Staging from S3 against boto3's own download of the same objects, side by side.

moto's S3 server runs on loopback in its own process, holding a synthetic adapter. Two clients,
each in its own process, take turns round by round (boto3, preload, boto3, ...):

- boto3: ``client.download_file`` of both objects into a fresh directory with boto3's default
  transfer settings: what fetching the bytes costs, and nothing else.
- preload: ``PreloadAdapter`` of the same prefix through a store in its own process, deleted
  again after each round (untimed), so that every round stages new content: download, validate,
  hash, fsync, commit and register. The store's progress
  events are timed on arrival, which splits a preload into its phases: resolve (listing and
  HEAD), download, validate (header, tensor digests), stage (content id, fsync, commit).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path

_DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_BUCKET = "lorastream-bench"
_PREFIX = "adapters/staging"
_FILES = ("adapter_config.json", "adapter_model.safetensors")
PHASES = ("resolve", "download", "validate", "stage")


def _run_moto(ports: mp.Queue[int]) -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    ports.put(server.get_host_and_port()[1])
    while True:
        time.sleep(3600)


def _run_store(cache_dir: str, endpoint: str, ports: mp.Queue[int]) -> None:
    from lorastream.store.config import StoreSettings
    from lorastream.store.server import create_server

    os.environ.update(_DUMMY_AWS)
    server, port, _ = create_server(StoreSettings(port=0, cache_dir=Path(cache_dir),
                                                  s3_endpoint_url=endpoint))
    server.start()
    ports.put(port)
    server.wait_for_termination()


def _s3_client(endpoint: str):
    import boto3
    from botocore.config import Config

    os.environ.update(_DUMMY_AWS)
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"})
    )


def _run_boto3_client(endpoint: str, scratch: str, conn: Connection) -> None:
    """On each message, download both objects into a fresh directory; send back the seconds."""
    client = _s3_client(endpoint)
    while conn.recv():
        dest = Path(tempfile.mkdtemp(dir=scratch))
        start = time.perf_counter()
        for name in _FILES:
            client.download_file(_BUCKET, f"{_PREFIX}/{name}", str(dest / name))
        conn.send({"total": time.perf_counter() - start})
        shutil.rmtree(dest)


def _run_preload_client(target: str, uri: str, conn: Connection) -> None:
    """On each message, preload ``uri`` and delete it again; send back the seconds of the
    preload, whole and per phase."""
    from lorastream.core.store_client import StoreClient

    marks = {"downloading": "resolve", "validating": "download", "staging": "validate",
             "done": "stage"}
    with StoreClient(target) as client:
        while conn.recv():
            start = last = time.perf_counter()
            times = dict.fromkeys(PHASES, 0.0)
            seen: set[str] = set()
            for event in client.preload(uri, "staging-bench"):
                if event.phase in marks and event.phase not in seen:  # first event of a phase
                    seen.add(event.phase)
                    now = time.perf_counter()
                    times[marks[event.phase]] += now - last
                    last = now
            times["total"] = time.perf_counter() - start
            client.delete("staging-bench")
            conn.send(times)


def _start(ctx: mp.context.SpawnContext, target: Callable[..., object], *args: object
           ) -> tuple[object, int]:
    ports = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, ports), daemon=True)
    proc.start()
    return proc, ports.get(timeout=120)


def measure_staging(adapter_dir: Path, repeats: int) -> dict[str, object]:
    """Preload from S3 against boto3's download of the same objects: medians over ``repeats``
    rounds after one warm-up; the ratio is the median of per-round (boto3 s / preload s)."""
    ctx = mp.get_context("spawn")
    procs: list = []
    seconds: dict[str, list[Mapping[str, float]]] = {"boto3": [], "preload": []}
    with tempfile.TemporaryDirectory(prefix="lorastream-staging-") as tmp:
        try:
            moto, moto_port = _start(ctx, _run_moto)
            procs.append(moto)
            endpoint = f"http://127.0.0.1:{moto_port}"
            s3 = _s3_client(endpoint)
            s3.create_bucket(Bucket=_BUCKET)
            for name in _FILES:
                s3.upload_file(str(adapter_dir / name), _BUCKET, f"{_PREFIX}/{name}")
            store, store_port = _start(ctx, _run_store, str(Path(tmp) / "cache"), endpoint)
            procs.append(store)
            conns: dict[str, Connection] = {}
            for kind, target, args in (
                ("boto3", _run_boto3_client, (endpoint, tmp)),
                ("preload", _run_preload_client,
                 (f"127.0.0.1:{store_port}", f"s3://{_BUCKET}/{_PREFIX}")),
            ):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=target, args=(*args, child), daemon=True)
                proc.start()
                procs.append(proc)
                conns[kind] = parent
            for round_ in range(repeats + 1):  # round 0 warms up
                for kind, conn in conns.items():
                    conn.send(True)
                    result = conn.recv()
                    if round_:
                        seconds[kind].append(result)
            for conn in conns.values():
                conn.send(False)
        finally:
            for proc in procs:
                proc.kill()
    return _summary(sum(os.path.getsize(adapter_dir / n) for n in _FILES), repeats, seconds)


def _summary(
    nbytes: int, repeats: int, seconds: Mapping[str, list[Mapping[str, float]]]
) -> dict[str, object]:
    median = statistics.median
    boto3_s = [r["total"] for r in seconds["boto3"]]
    preload_s = [r["total"] for r in seconds["preload"]]
    ratio = median(b / p for b, p in zip(boto3_s, preload_s, strict=True))
    return {
        "adapter_bytes": nbytes,
        "repeats": repeats,
        "boto3_s": round(median(boto3_s), 3),
        "preload_s": round(median(preload_s), 3),
        "boto3_MBps": round(nbytes / median(boto3_s) / 1e6, 1),
        "preload_MBps": round(nbytes / median(preload_s) / 1e6, 1),
        "preload_phases_s": {
            phase: round(median(r[phase] for r in seconds["preload"]), 3) for phase in PHASES
        },
        "preload_vs_boto3": round(ratio, 3),
        "goal": "preload_vs_boto3 >= 0.9",
        "goal_met": ratio >= 0.9,
    }
