"""The transfer section of the benchmark page: the store stream and the verified stream against
bare gRPC (one verified client per tensor digest), each digest's rate alone, and staging from S3
against boto3's own download. Results from before the digests or the staging comparison render
with what they hold."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchpage.plots import format_bytes
from benchpage.report_format import (
    GOALS_HEADER,
    Result,
    as_number,
    goal_row,
    number,
    paragraphs,
    plot_image,
    ratio,
    table,
    text,
)

# verified client (as in the points) -> the tensor digest its manifest carries
_VERIFIED = (("verified_sha256", "sha256"), ("verified_blake3", "blake3"),
             ("verified_xxh3", "xxh3-128"))


def transfer_goals(r: Result) -> list[list[str]]:
    chunk = as_number(r.get("chunk_bytes"))
    at = f" at {format_bytes(chunk)} chunks" if chunk else ""
    rows = [goal_row(f"store stream / bare gRPC{at}", r.get("store_vs_bare"), r.get("goal"))]
    if "goal_verified" in r:
        rows.append(goal_row(f"verified stream ({text(r.get('verified_digest'))}) / bare gRPC{at}",
                             r.get("store_verified_vs_bare"), r.get("goal_verified")))
    if "goal_verified_kept" in r:
        rows.append(goal_row(
            f"verified stream ({text(r.get('verified_digest'))}) / bare gRPC, both keeping freed "
            f"buffers{at}", r.get("store_verified_vs_bare_kept"), r.get("goal_verified_kept")))
    staging = r.get("staging")
    if isinstance(staging, Mapping):
        mb = as_number(staging.get("adapter_bytes"))
        size = number(mb / 1e6 if mb else None, 0)
        rows.append(goal_row(f"S3 preload / boto3 download, {size} MB",
                             staging.get("preload_vs_boto3"), staging.get("goal")))
    return rows


def _points(r: Result) -> list[Mapping[str, Any]]:
    points = list(r.get("points") or [])
    if not points:  # a result from before the chunk-size sweep: its one point is at top level
        points = [{"chunk_bytes": r.get("chunk_bytes"), "bare_mb_s": r.get("bare_grpc_MBps"),
                   "store_mb_s": r.get("store_stream_MBps"),
                   "verified_mb_s": r.get("store_verified_MBps"),
                   "store_vs_bare": r.get("store_vs_bare"),
                   "verified_vs_bare": r.get("store_verified_vs_bare")}]
    return sorted(points, key=lambda p: as_number(p.get("chunk_bytes")) or 0)


def _stream_table(r: Result) -> str:
    points = _points(r)
    by_digest = [(k, d) for k, d in _VERIFIED if any(f"{k}_mb_s" in p for p in points)]
    if not by_digest:  # before the digests: one verified client, sha256
        rows = [[format_bytes(as_number(p.get("chunk_bytes")) or 0), number(p.get("bare_mb_s"), 0),
                 number(p.get("store_mb_s"), 0), number(p.get("verified_mb_s"), 0),
                 ratio(p.get("store_vs_bare")), ratio(p.get("verified_vs_bare"))] for p in points]
        return table(["chunk", "bare gRPC MB/s", "store MB/s", "store, landed + sha256 MB/s",
                      "store / bare", "verified / bare"], rows)
    kept = any("bare_kept_mb_s" in p for p in points)
    header = ["chunk", "bare gRPC MB/s"]
    header += ["bare, buffers kept: MB/s / bare"] if kept else []
    header += ["store MB/s / bare"]
    header += [f"verified, {d}: MB/s / bare" for _, d in by_digest]
    rows = []
    for p in points:
        row = [format_bytes(as_number(p.get("chunk_bytes")) or 0), number(p.get("bare_mb_s"), 0)]
        if kept:
            row.append(f"{number(p.get('bare_kept_mb_s'), 0)} / "
                       f"{ratio(p.get('bare_kept_vs_bare'))}")
        row.append(f"{number(p.get('store_mb_s'), 0)} / {ratio(p.get('store_vs_bare'))}")
        row += [f"{number(p.get(f'{k}_mb_s'), 0)} / {ratio(p.get(f'{k}_vs_bare'))}"
                for k, _ in by_digest]
        rows.append(row)
    return table(header, rows)


def _headline(r: Result) -> Mapping[str, Any] | None:
    chunk = as_number(r.get("chunk_bytes"))
    return next((p for p in _points(r) if as_number(p.get("chunk_bytes")) == chunk), None)


def _buffers_parts(r: Result) -> list[str]:
    """What keeping freed buffers is worth, from the headline point's client CPU per MB."""
    head = _headline(r)
    if head is None or "bare_kept_cpu_ms_per_mb" not in head:
        return []
    clients = [("bare", "bare gRPC"), ("bare_kept", "bare gRPC, buffers kept"),
               ("store", "store (CRC-32C per chunk)"),
               *((k, f"verified, {d}, buffers kept") for k, d in _VERIFIED)]
    rows = [[label, number(head.get(f"{k}_cpu_ms_per_mb"), 2), number(head.get(f"{k}_mb_s"), 0)]
            for k, label in clients if f"{k}_cpu_ms_per_mb" in head]
    return [
        "**Freed buffers.** Every message is received into buffers of its own (gRPC's, then "
        "Python's `bytes`), freed once the chunk is landed. At glibc's defaults a freed 1 MB "
        "buffer goes back to the system, so the next message faults in fresh pages (the gap "
        "between `bare` and `bare, buffers kept` below). The worker's fetch process therefore "
        "has glibc keep freed buffers for the next message (`native_env.keep_freed_buffers`, "
        "`mallopt`), and so do the verified clients here; `bare, buffers kept` is the bare "
        "client given the same setting, to compare on equal terms. Client CPU per MB at the "
        f"{format_bytes(as_number(head.get('chunk_bytes')) or 0)} point (the client process, "
        "every thread, median over rounds):",
        table(["client", "CPU ms per MB", "MB/s"], rows),
        "On equal terms the verified stream runs at "
        f"{ratio(head.get('verified_vs_bare_kept'))} of the bare one: its client does what the "
        "bare one does plus, per byte, one landing copy into the arena and one "
        "hash pass, and per chunk the framing and per-tensor checks in Python, all on the one "
        "core the store does not use. The landing copy is the worker's job (the arena is what "
        "the load stream copies to the device from), and gRPC's Python API hands each message "
        "over as a new `bytes`, so no receive lands in place.",
    ]


def _hash_table(r: Result) -> str | None:
    rates = r.get("hash_GBps")
    if not isinstance(rates, Mapping):
        return None
    labels = {"sha256": "sha256", "blake3": "BLAKE3, one thread",
              "blake3_auto": "BLAKE3, its thread pool (max_threads=AUTO)",
              "xxh3_128": "xxh3-128",
              "crc32c": "CRC-32C (each end, per chunk, when the receiver checks chunks only)"}
    return table(["check, tensor by tensor over the adapter", "GB/s alone"],
                 [[labels.get(k) or str(k), number(v, 2)] for k, v in rates.items()])


def _blake3_vs_sha256(r: Result) -> str:
    """"N× faster" from the hash table's one-thread rates, or "faster" when it was not measured."""
    rates = r.get("hash_GBps")
    rates = rates if isinstance(rates, Mapping) else {}
    blake3, sha256 = as_number(rates.get("blake3")), as_number(rates.get("sha256"))
    return f"{ratio(blake3 / sha256)} faster" if blake3 and sha256 else "faster"


def _staging_parts(r: Result) -> list[str]:
    staging = r.get("staging")
    if not isinstance(staging, Mapping):
        return []
    phases = staging.get("preload_phases_s") or {}
    mb = as_number(staging.get("adapter_bytes"))
    return [
        f"**Staging from S3.** A synthetic adapter of {number(mb / 1e6 if mb else None, 0)} MB "
        "lies in moto's S3 server (loopback, its own process). Round by round, boto3 downloads "
        "both objects with its default transfer settings (`download_file`), and the store stages "
        "the same prefix through `PreloadAdapter` (then the adapter is deleted, untimed, so every "
        f"round stages anew): {text(staging.get('repeats'))} measured rounds after a warm-up, "
        "medians; the ratio is the median of per-round ratios. The preload's phases are timed "
        "from its progress events.",
        table(["", "seconds", "MB/s"], [
            ["boto3 `download_file`, both objects", number(staging.get("boto3_s"), 3),
             number(staging.get("boto3_MBps"), 0)],
            ["`PreloadAdapter`", number(staging.get("preload_s"), 3),
             number(staging.get("preload_MBps"), 0)],
            *[[f"… {phase}", number(seconds, 3), ""] for phase, seconds in phases.items()],
            ["preload / boto3 (rate)", ratio(staging.get("preload_vs_boto3")), ""],
        ]),
        "The store hashes while it downloads: each file goes through an in-order writer "
        "(`lorastream/store/digesting.py`; s3transfer still fetches the parts concurrently and "
        "writes them in order from its in-memory window), which feeds the content id's sha256 "
        "and every tensor's sha256 and fast digest as the bytes arrive. Validation then reads "
        "only the header and staging only fsyncs and renames: before, the two hash passes over "
        "the staged files (tensor digests, then the content id) came after the download. The "
        "fsync finds the file on disk already: a thread beside the writer `fdatasync`s it every "
        "4 MB while the rest downloads (`lorastream/store/writeback.py`). Before, nearly all of "
        "the stage phase was that fsync.",
    ]


def transfer_section(r: Result, plots: Mapping[str, str]) -> str:
    size = as_number(r.get("adapter_bytes"))
    digest = text(r.get("verified_digest")) if "verified_digest" in r else "sha256"
    hash_table = _hash_table(r)
    parts = [
        f"A synthetic adapter of {number(size / 1e6 if size else None, 0)} MB (rank "
        f"{text(r.get('adapter_rank'))}, all linear layers of SmolLM2-135M) is staged in the "
        "store and streamed over loopback by one client of each kind, each in its own process, "
        f"round by round: {text(r.get('repeats'))} measured rounds per chunk size after one "
        "warm-up. Rates are medians over rounds; ratios are medians of the per-round ratios.",
        _stream_table(r),
        table(GOALS_HEADER, transfer_goals(r)),
        plot_image(plots, "transfer", "Transfer rate against chunk size"),
        "- **bare**: a server streaming pre-cut raw `bytes` chunks from memory, to a client that "
        "only counts them, with the store client's stream channel options (single-threaded "
        "unary-stream calls, `STREAM_GRPC_OPTIONS`): the fastest gRPC moves these bytes here "
        "in a process at glibc's defaults.\n"
        "- **bare, buffers kept**: the same client in a process that keeps freed buffers (see "
        "Freed buffers, below).\n"
        "- **store**: the store reads the staged file chunk by chunk, checksums (CRC-32C) and "
        "frames each chunk as a `StreamAdapterTensorsResponse`; the client decodes and checks "
        "every chunk.\n"
        "- **verified**: what a worker does: the store frames the chunks as for store, but "
        "without their CRC-32C (the client sets `skip_chunk_crc`: the tensor digests cover the "
        "bytes end to end), and the client lands every chunk at its offset in a buffer "
        "allocated and faulted in once, as the worker's host arena is, and checks every tensor "
        "against the digest its manifest carries. One client per digest, each from a store "
        "staging with it: sha256 (what manifests staged before the fast digest get), BLAKE3, "
        f"xxh3-128. The headline is {digest}, the store's default. Its process keeps freed "
        "buffers, as the worker's fetch process does.",
        *([hash_table] if hash_table else []),
        "Why xxh3-128 by default: sha256 bounds the verified stream (it hashes at about the "
        "rate gRPC delivers, on the same cores); BLAKE3 is "
        f"{_blake3_vs_sha256(r)} per core but its "
        "thread pool only loses on tensors of hundreds of KB; xxh3-128 runs at memory speed, so "
        "verification costs no more than the landing copy. It is not cryptographic: it catches "
        "corruption (a chunk landed at the wrong offset, a resume that skipped bytes, bytes that "
        "changed on the store's disk after staging), not someone who can rewrite staged files "
        "to match it; the content id stays sha256 over the staged files, checked by the store "
        "(docs/store.md, Verification). `--tensor-digest blake3` keeps tamper evidence.",
        *_buffers_parts(r),
        *_staging_parts(r),
        "What makes the store stream about as fast as bare gRPC:\n\n"
        "- **chunks run across tensor boundaries** (`lorastream/core/stream_layout.py`): one "
        "message per tensor would multiply the messages of a many-tensor adapter;\n"
        "- **the chunk message is encoded by the codec directly** "
        "(`codec.encode_chunk_response`, checked byte for byte against protobuf): building a "
        "large `bytes` field through the Python protobuf runtime costs more than gRPC itself; "
        "the client decodes the payload as a zero-copy view;\n"
        "- **CRC-32C** (`crc32c` package, hardware-accelerated) instead of `zlib.crc32` on each "
        "end.\n\n"
        "Small chunks pay the per-message cost of gRPC many times; very large ones lose the "
        "pipelining between reading, sending and decoding. On a shared VM the bare stream itself "
        "moves between invocations; the interleaved rounds keep the comparison fair within one.",
    ]
    return paragraphs(parts)
