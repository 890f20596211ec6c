"""The peer system: HF transformers + PEFT serving the same requests, in static mixed-adapter
batches, in this process.

Requests are taken in arrival order, ``batch`` at a time; each batch is one left-padded, greedy
``generate`` call with ``adapter_names=`` (PEFT's mixed-adapter batches), producing exactly
``max_tokens`` new tokens per request. An adapter is loaded (``load_adapter``) the first time a
batch needs it, and that time counts: it is what a PEFT deployment pays for a new adapter. All
requests are available at t=0 (offline), which favours PEFT over the online Poisson replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from lorastream.bench.harness import PROMPTS
from lorastream.core.peft_writer import write_peft_dir
from lorastream.core.store_client import BytesSink, StoreClient


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` [B, S] of a batch left-padded for ``generate``."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return input_ids, mask


@dataclass(frozen=True)
class MixedPeft:
    """HF transformers + PEFT in fp32 with adapters ``a0 .. a<adapters-1>`` all loaded, for
    mixed-adapter batches (``adapter_names=``)."""

    model: Any  # peft.PeftModel
    pad: int  # the pad id for left-padded batches (:func:`pad_token`)
    adapters: int


def load_mixed_peft(checkpoint: Path, dirs: list[Path]) -> MixedPeft:
    """The base model from ``checkpoint`` with adapter ``dirs[i]`` loaded as ``a<i>``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, dirs[0], adapter_name="a0")
    for i, path in enumerate(dirs[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    model.eval()
    return MixedPeft(model, pad_token(base.config), len(dirs))


def pad_token(config: object) -> int:
    """The pad id for ``generate``: the model's pad id (Gemma, Phi-3 have one), else its eos id
    (a Llama has no pad token; the first of a list), else 0."""
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int):
            return value
    return 0


def fetch_peft_dirs(store: str, names: list[str], out_root: Path) -> dict[str, Path]:
    """Stream each adapter from the store and write it as a PEFT directory under ``out_root``."""
    dirs = {}
    with StoreClient(store) as client:
        for name in names:
            sink = BytesSink()
            manifest = client.stream_tensors(name, sink)
            dirs[name] = write_peft_dir(manifest, sink.buffers, out_root / name)
    return dirs


def _prompt_ids(checkpoint: Path) -> list[list[int]]:
    """Token ids of :data:`PROMPTS`, through the chat template exactly as the worker applies it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    return [
        list(cast(list[int], tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in prompt.messages or ()],
            add_generation_prompt=True, tokenize=True, return_dict=False,
        )))
        for prompt in PROMPTS
    ]


def run_peft_peer(
    checkpoint: Path,
    requests: list[tuple[str, int]],
    adapter_dirs: dict[str, Path],
    *,
    max_tokens: int,
    batch: int,
) -> dict[str, object]:
    """Serve ``requests`` (adapter name, question index) in arrival order with HF + PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompt_ids = _prompt_ids(checkpoint)
    base = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    pad = pad_token(base.config)
    with torch.no_grad():  # warm-up, untimed (the worker gets one too)
        base.generate(
            input_ids=torch.tensor([prompt_ids[0]]), max_new_tokens=2, do_sample=False,
            pad_token_id=pad,
        )
    model: PeftModel | None = None
    loaded: set[str] = set()
    load_seconds = generate_seconds = 0.0
    tokens = 0
    start = time.perf_counter()
    for first in range(0, len(requests), batch):
        chunk = requests[first : first + batch]
        t = time.perf_counter()
        for name, _ in chunk:
            if name in loaded:
                continue
            if model is None:
                model = PeftModel.from_pretrained(base, str(adapter_dirs[name]), adapter_name=name)
                model.eval()
            else:
                model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
            loaded.add(name)
        assert model is not None
        t_loaded = time.perf_counter()
        input_ids, mask = left_padded([prompt_ids[q] for _, q in chunk], pad)  # [B, S]
        width = input_ids.shape[1]
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, adapter_names=[n for n, _ in chunk],
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                pad_token_id=pad,
            )
        tokens += (out.shape[1] - width) * len(chunk)
        load_seconds += t_loaded - t
        generate_seconds += time.perf_counter() - t_loaded
    elapsed = time.perf_counter() - start
    return {
        "requests": len(requests),
        "batch_size": batch,
        "batches": -(-len(requests) // batch),
        "adapters_loaded": len(loaded),
        "adapter_load_seconds": round(load_seconds, 2),
        "generate_seconds": round(generate_seconds, 2),
        "elapsed_seconds": round(elapsed, 2),
        "tokens": tokens,
        "throughput_tok_s": round(tokens / elapsed, 1),
        "throughput_req_s": round(len(requests) / elapsed, 2),
    }
