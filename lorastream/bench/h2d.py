"""Host -> device rate of the adapter load path on CUDA, against the pinned-copy limit.

UNMEASURED: this project's machines have no GPU, so this benchmark has never run here and no
number in the repository comes from it; it refuses to run without CUDA (exit status 2). Its
first GPU run (``make bench-gpu``) is the first measurement.

A synthetic Llama-3-8B all-linear adapter (rank 16, bf16: about 84 MB, docs/design.md's
"numbers to keep in mind") is measured three ways, each the median of ``repeats`` runs:

- pinned limit: the adapter's bytes as one pinned host buffer, copied to the device with one
  ``non_blocking`` copy on a side stream (CUDA events): the fastest this host moves them;
- load path: the adapter landed in a pinned host buffer (``HostAdapterBuffer`` on a CUDA
  ``Device``, as a fetch lands it) and copied into a LoRA slot by the load stream with the
  worker's own copy operations (``LoraSlots.write_ops``, as ``DeviceTier`` submits them), timed
  with CUDA events recorded on the load stream around the job;
- landing: reading the adapter from disk (page cache) into the pinned buffer, checksums
  included (``AdapterFetcher.read_local``), on the host.

``load_vs_pinned`` is the load path's rate over the pinned limit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lorastream.bench.synthetic import BaseShape, make_synthetic_adapter

LLAMA3_8B = BaseShape(
    hidden=4096, intermediate=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128
)
_LLAMA3_8B_CONFIG = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": False,
}


def _median_ms(run: Callable[[], float], repeats: int) -> float:
    run()  # warm-up: first-touch of the device memory, lazy CUDA init
    return statistics.median(run() for _ in range(repeats))


def run_h2d_bench(rank: int = 16, repeats: int = 20) -> dict[str, object]:
    """Measure the three rates above on the current CUDA device; RuntimeError without one."""
    if not torch.cuda.is_available():
        raise RuntimeError("the host -> device benchmark needs a CUDA GPU (none found); "
                           "it is unmeasured on this project's CPU-only machines")
    from lorastream.bench.machine import command_line
    from lorastream.worker.device.device import Device
    from lorastream.worker.loading.adapter import adapter_weights
    from lorastream.worker.loading.fetch import AdapterFetcher
    from lorastream.worker.lora.slots import LoraSlots
    from lorastream.worker.model.config import ModelConfig

    cuda = torch.device("cuda")
    device = Device(cuda)
    config = ModelConfig.from_dict(_LLAMA3_8B_CONFIG, "llama3-8b-shape")
    with tempfile.TemporaryDirectory(prefix="lorastream-h2d-") as tmp:
        adapter = make_synthetic_adapter(Path(tmp) / "adapter", LLAMA3_8B, rank=rank,
                                         dtype=torch.bfloat16)
        fetcher = AdapterFetcher(device, None)
        landing_s: list[float] = []
        for _ in range(max(3, repeats // 4)):
            began = time.perf_counter()
            buffer = fetcher.read_local("h2d", adapter)
            landing_s.append(time.perf_counter() - began)
    assert buffer.buffer is not None and buffer.buffer.is_pinned()
    weights = adapter_weights(buffer, config, rank)
    nbytes = weights.nbytes
    slots = LoraSlots(config, 1, rank, torch.bfloat16, cuda)
    stream = torch.cuda.Stream()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=cuda)

    def pinned_copy() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            target.copy_(pinned, non_blocking=True)
            end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def load_path() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ops = slots.write_ops(0, weights.adapter_id, weights.rank, weights.scaling,
                              list(weights.blocks))
        done = device.load_stream.submit([start.record, *ops, end.record])  # on the load stream
        done.wait()
        return start.elapsed_time(end)

    pinned_ms = _median_ms(pinned_copy, repeats)
    load_ms = _median_ms(load_path, repeats)
    device.close()
    pinned_gbps, load_gbps = nbytes / pinned_ms / 1e6, nbytes / load_ms / 1e6
    return {
        "benchmark": "h2d",
        "command": command_line(),
        "note": "unmeasured on this project's CPU-only machines: the first GPU numbers",
        "gpu": torch.cuda.get_device_name(cuda),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "adapter": f"Llama-3-8B all-linear, rank {rank}, bf16",
        "adapter_bytes": nbytes,
        "repeats": repeats,
        "pinned_limit_GBps": round(pinned_gbps, 2),
        "load_path_GBps": round(load_gbps, 2),
        "load_vs_pinned": round(load_gbps / pinned_gbps, 3),
        "landing_GBps": round(nbytes / statistics.median(landing_s) / 1e9, 2),
        "pinned_copy_ms": round(pinned_ms, 3),
        "load_path_ms": round(load_ms, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print (or write) its JSON; exit status 2 when CUDA is missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    try:
        result = run_h2d_bench(args.rank, args.repeats)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
