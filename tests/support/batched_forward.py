"""One forward of the model over a mixed batch, without the engine: the set-up the logit
comparisons against PEFT share (dense families, DoRA, vocabulary modules).

:func:`model_and_slots` loads a checkpoint and writes each adapter into its slot as the load
path does (read, checked against the base, written); :func:`prefill_last_logits` prefills one
prompt for every name in one batch per chunk and returns each row's last logits;
:func:`preloaded_store` is a real store on port 0 holding the adapters, validated and staged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from lorastream.core.store_client import StoreClient
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.backend import LoraStep, RowLora, TorchLoraBackend
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.forward_batch import ForwardBatch, PrefillSpan
from lorastream.worker.model.kv_cache import KVCache, slot_mapping
from lorastream.worker.model.weights import load_weights

CPU = torch.device("cpu")


def model_and_slots(
    checkpoint: Path, adapters: dict[str, Path], rank: int = 16, first_slot: int = 0,
    quantization: str = "none",
) -> tuple[DecoderModel, LoraSlots, dict[str, int]]:
    """The fp32 model of ``checkpoint`` (in ``quantization``'s mode) and slots holding
    ``adapters`` from slot ``first_slot`` on; ``slot_of``: name -> slot."""
    config = ModelConfig.from_dir(checkpoint)
    weights = load_weights(checkpoint, config, torch.float32, CPU)
    model = DecoderModel(config, weights, CPU, quantization)  # type: ignore[arg-type]  # a mode name
    slots = LoraSlots(config, first_slot + len(adapters), rank, torch.float32, CPU, base=model)
    fetcher = AdapterFetcher(Device("cpu"), None)
    slot_of = {}
    for slot, (name, path) in enumerate(adapters.items(), start=first_slot):
        w = adapter_weights(fetcher.read_local(name, path), config, rank)
        slots.write(slot, w.adapter_id, w.rank, w.scaling, list(w.blocks), folds=w.folds)
        slot_of[name] = slot
    return model, slots, slot_of


def prefill_last_logits(
    model: DecoderModel, slots: LoraSlots, slot_of: Mapping[str, RowLora], names: list[str],
    prompt: list[int], chunk: int | None = None, backend: TorchLoraBackend | None = None,
    on_step: Callable[[LoraStep], None] | None = None,
) -> torch.Tensor:  # [names, V]
    """Every name's prefill of ``prompt`` in one batch per chunk of ``chunk`` tokens (None: the
    whole prompt); the last token's logits. ``slot_of``: a name's slot or weighted mix of
    ``(slot, weight)`` (the backend's ``RowLora``); a name without one: the base model.
    ``backend``: the LoRA backend (None: torch's, Python ops); ``on_step``: shown each step's
    :class:`LoraStep` before its forward pass (a test's look at the layout chosen)."""
    config = model.config
    kv = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, 8 << 20,
                 torch.float32, CPU)
    backend = backend or TorchLoraBackend(torch.float32, CPU)
    tables = {name: kv.allocator.allocate(len(prompt)) for name in names}
    chunk = chunk or len(prompt)
    done, logits = 0, torch.empty(0)
    while done < len(prompt):  # every sequence prefills the same chunk each step
        length = min(chunk, len(prompt) - done)
        ids: list[int] = []
        positions: list[int] = []
        cache: list[int] = []
        token_slots: list[RowLora] = []
        spans, rows = [], []
        for name in names:
            table, start = tables[name], len(ids)
            ids += prompt[done : done + length]
            positions += range(done, done + length)
            cache += slot_mapping(table, done, length)
            token_slots += [slot_of.get(name, -1)] * length
            spans.append(PrefillSpan(start, length, done + length, torch.tensor(table)))
            rows.append(len(ids) - 1)
        batch = ForwardBatch(
            torch.tensor(ids), torch.tensor(positions), torch.tensor(positions) + 1,
            torch.tensor(cache), 0, torch.zeros(0, 0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long), tuple(spans), torch.tensor(rows),
        )
        lora = LoraStep.for_step(slots, backend, token_slots, torch.float32, CPU, logit_rows=rows)
        if on_step is not None and lora is not None:
            on_step(lora)
        logits = model.forward(batch, kv, lora)  # [names, V]
        done += length
    return logits


@contextmanager
def preloaded_store(adapters: dict[str, Path], root: Path) -> Iterator[str]:
    """A store on port 0 under ``root`` holding ``adapters`` (validated, staged); its target."""
    server, port, _ = create_store(StoreSettings(port=0, cache_dir=root / "store"))
    server.start()
    target = f"127.0.0.1:{port}"
    try:
        with StoreClient(target) as client:
            for name, path in adapters.items():
                for _ in client.preload(str(path), name):
                    pass
        yield target
    finally:
        server.stop(None).wait()
