"""GPU benchmark: SGMV shrink + expand against the base layer's matmul, Llama-3-8B shapes.

UNMEASURED: this project's machines have no GPU, so this benchmark has never been run here and
no number in the repository comes from it. It was written against the kernels' CPU-tested API
and refuses to run without CUDA. Treat its first GPU run as the first measurement.

For every projection of a Llama-3-8B layer (q, k, v, o, gate, up, down), every batch size, rank
and adapter popularity, it times

    base:  torch.mm(x, W.T)                                   x [B, K], W [N, K]
    lora:  sgmv_shrink(x, A, ...) then sgmv_expand(h, B, ..., out)   (one step's metadata)

with CUDA events (median of `repeat` runs after `warmup`) and reports `overhead = lora / base`
per projection and summed over a layer. The metadata is built once per configuration, outside the
timed region, as the engine builds it once per step; its host build time is reported separately.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lorastream.kernels.metadata import SgmvMetadata
from lorastream.kernels.sgmv import sgmv_expand, sgmv_shrink
from lorastream.kernels.workloads import segment_lengths, token_slots_for

UNMEASURED_NOTE = (
    "unmeasured on this project's CPU-only machines: this benchmark has never been run by "
    "lorastream's authors; these are the first GPU numbers, not a reproduction of published ones"
)


@dataclass(frozen=True)
class Projection:
    """One linear layer of the base model: y[B, out_features] = x[B, in_features] @ W.T."""

    name: str
    in_features: int
    out_features: int


LLAMA3_8B_PROJECTIONS = (
    Projection("q_proj", 4096, 4096),
    Projection("k_proj", 4096, 1024),
    Projection("v_proj", 4096, 1024),
    Projection("o_proj", 4096, 4096),
    Projection("gate_proj", 4096, 14336),
    Projection("up_proj", 4096, 14336),
    Projection("down_proj", 14336, 4096),
)


def run_kernel_bench(
    batch_sizes: Sequence[int] = (1, 4, 16, 32, 64, 128, 256),
    ranks: Sequence[int] = (16, 64),
    popularities: Sequence[str] = ("distinct", "uniform"),
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 10,
    repeat: int = 50,
    seed: int = 0,
) -> dict[str, Any]:
    """Time LoRA shrink + expand against the base matmul; return JSON-ready results.

    Raises:
        RuntimeError: CUDA is not available (every machine of this project), or Triton is not
            installed.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the kernel benchmark needs a CUDA GPU and none is available; it is unmeasured on "
            "this project's CPU-only machines (run it on a GPU host with triton==3.7.1)"
        )
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(seed)
    num_slots = max(len(segment_lengths(b, p)) for b in batch_sizes for p in popularities)
    rows: list[dict[str, Any]] = []
    for projection in LLAMA3_8B_PROJECTIONS:
        for rank in ranks:
            storage = _SlotStorage.random(projection, num_slots, rank, dtype, device)
            for popularity in popularities:
                for batch_size in batch_sizes:
                    slots_cpu = token_slots_for(
                        segment_lengths(batch_size, popularity), num_slots, generator
                    )  # [B]
                    rows.append(_time_config(storage, popularity, slots_cpu, warmup, repeat))
            del storage
            torch.cuda.empty_cache()
    return {
        "benchmark": "sgmv_kernels",
        "note": UNMEASURED_NOTE,
        "model_shapes": "Llama-3-8B (hidden 4096, q 4096, kv 1024, intermediate 14336)",
        "device": torch.cuda.get_device_name(device),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "dtype": str(dtype).removeprefix("torch."),
        "warmup": warmup,
        "repeat": repeat,
        "results": rows,
        "per_layer": _per_layer(rows),
    }


@dataclass
class _SlotStorage:
    """One projection's base weight and LoRA slot storage, every slot at the same rank."""

    projection: Projection
    weight: torch.Tensor  # [N, K]
    lora_a: torch.Tensor  # [S, R, K]
    lora_b: torch.Tensor  # [S, N, R]
    ranks_cpu: torch.Tensor  # [S] int32, host
    ranks: torch.Tensor  # [S] int32, device
    scalings: torch.Tensor  # [S] float32, device

    @classmethod
    def random(
        cls,
        projection: Projection,
        num_slots: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> _SlotStorage:
        n, k = projection.out_features, projection.in_features
        ranks_cpu = torch.full((num_slots,), rank, dtype=torch.int32)
        return cls(
            projection=projection,
            weight=torch.randn(n, k, dtype=dtype, device=device) / k**0.5,
            lora_a=torch.randn(num_slots, rank, k, dtype=dtype, device=device) / k**0.5,
            lora_b=torch.randn(num_slots, n, rank, dtype=dtype, device=device) / rank**0.5,
            ranks_cpu=ranks_cpu,
            ranks=ranks_cpu.to(device),
            scalings=torch.ones(num_slots, dtype=torch.float32, device=device),
        )


def _time_config(
    storage: _SlotStorage, popularity: str, slots_cpu: torch.Tensor, warmup: int, repeat: int
) -> dict[str, Any]:
    """Time the base matmul and LoRA shrink + expand for one batch; one result row."""
    device = storage.weight.device
    projection = storage.projection
    batch_size = slots_cpu.numel()
    started = time.perf_counter()
    meta = SgmvMetadata.from_slots(slots_cpu, storage.ranks_cpu, device)
    meta_us = (time.perf_counter() - started) * 1e6
    slots = slots_cpu.to(device)  # [B]
    x = torch.randn(batch_size, projection.in_features, dtype=storage.weight.dtype, device=device)
    out = torch.empty(batch_size, projection.out_features, dtype=x.dtype, device=device)

    def base() -> None:
        torch.mm(x, storage.weight.t(), out=out)

    def lora() -> None:
        h = sgmv_shrink(x, storage.lora_a, slots, storage.ranks, meta)  # [B, R]
        sgmv_expand(h, storage.lora_b, slots, storage.ranks, storage.scalings, out, meta=meta)

    base_us = _median_us(base, warmup, repeat)
    lora_us = _median_us(lora, warmup, repeat)
    return {
        "projection": projection.name,
        "in_features": projection.in_features,
        "out_features": projection.out_features,
        "rank": storage.lora_a.shape[1],
        "popularity": popularity,
        "batch_size": batch_size,
        "base_us": base_us,
        "lora_us": lora_us,
        "overhead": lora_us / base_us,
        "metadata_build_us": meta_us,
    }


def _median_us(fn: Callable[[], None], warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(_timing_event(), _timing_event()) for _ in range(repeat)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(start.elapsed_time(end) for start, end in events)) * 1e3


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def _per_layer(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sum base and LoRA time over the projections of one layer, per configuration."""
    totals: dict[tuple[int, str, int], list[float]] = {}
    for row in rows:
        key = (row["rank"], row["popularity"], row["batch_size"])
        total = totals.setdefault(key, [0.0, 0.0])
        total[0] += row["base_us"]
        total[1] += row["lora_us"]
    return [
        {
            "rank": rank,
            "popularity": popularity,
            "batch_size": batch_size,
            "base_us": base_us,
            "lora_us": lora_us,
            "overhead": lora_us / base_us,
        }
        for (rank, popularity, batch_size), (base_us, lora_us) in totals.items()
    ]


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print (or write) its JSON; exit status 2 when CUDA is missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 4, 16, 32, 64, 128, 256])
    parser.add_argument("--ranks", type=_int_list, default=[16, 64])
    parser.add_argument("--popularities", default="distinct,uniform")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--output", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    try:
        result = run_kernel_bench(
            batch_sizes=args.batch_sizes,
            ranks=args.ranks,
            popularities=args.popularities.split(","),
            dtype=getattr(torch, args.dtype),
            warmup=args.warmup,
            repeat=args.repeat,
        )
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as file:
            file.write(text + "\n")
        print(f"wrote {args.output} ({UNMEASURED_NOTE})", file=sys.stderr)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
