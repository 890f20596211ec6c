"""The push benchmark's section and goal row on the benchmark page."""

from __future__ import annotations

from collections.abc import Mapping

from benchpage.report_format import (
    MISSING,
    Result,
    get,
    goal_row,
    ms,
    number,
    paragraphs,
    ratio,
    table,
    text,
)


def push_goals(r: Result) -> list[list[str]]:
    return [goal_row("adapter from memory to first token, S3 then preload / push (p50)",
                     r.get("s3_over_push"), r.get("goal"))]


def push_section(r: Result, plots: Mapping[str, str]) -> str:
    c = r.get("config") or {}

    def p50(path: str, part: str) -> str:
        return ms(get(r, path, part, "p50"))

    rows = [
        ["push (`push_state_dict`, UploadAdapter)", MISSING, MISSING, p50("push", "staged_ms"),
         p50("push", "request_ms"), p50("push", "total_ms")],
        ["S3 `put_object`, then PreloadAdapter", p50("s3", "put_ms"), p50("s3", "preload_ms"),
         p50("s3", "staged_ms"), p50("s3", "request_ms"), p50("s3", "total_ms")],
    ]
    header = ("path", "write to S3 (ms)", "preload (ms)", "staged (ms)",
              "request to first token (ms)", "memory to first token (ms)")
    return paragraphs([
        f"A {number(r.get('adapter_mb'), 2)} MB adapter (rank {text(c.get('rank'))}, "
        f"{text(c.get('targets'))}, fp16, model {text(c.get('model'))}) is in a training "
        "loop's memory as a state dict; the clock stops at the first streamed token of a "
        "request for it through a worker. **push**: `push_state_dict` serialises it and uploads "
        "it to the store (acknowledged once staged). **S3**: the same serialisation, boto3 "
        "`put_object` of the safetensors and the config to moto's S3 server on loopback, then "
        "`PreloadAdapter` of that prefix. One store, worker and S3 server serve both, in the "
        f"same run: {text(r.get('rounds'))} rounds after an untimed warm-up, the two paths "
        "taking turns (each round with new weights, so nothing is cached). Each figure is the "
        "p50 over the rounds.",
        table(header, rows),
        f"S3 then preload takes {ratio(r.get('s3_over_push'))} the time of a push. The push "
        "skips the object store's write and the store's download from it: the bytes travel "
        "once, from the trainer to the store, where they are validated and staged as from any "
        "source. The request after either costs the same: the worker fetches the staged "
        "adapter from the store and loads it. S3 here is on loopback; a real bucket adds its "
        "network round trips to both the write and the download.",
    ])
