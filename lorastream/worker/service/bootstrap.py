"""Build a ready :class:`Engine` from :class:`WorkerSettings` (the one place that does)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import cast

import torch
from transformers import AutoTokenizer

from lorastream.core.errors import InvalidArgument
from lorastream.core.tls import ClientTLS
from lorastream.worker.device.cpu.native_env import waits_actively
from lorastream.worker.device.cpu.priority import starvation_warning
from lorastream.worker.device.device import Device
from lorastream.worker.device.quant_matmul import (
    quantization_slow_here,
    quantization_unsupported,
)
from lorastream.worker.engine.detokenizer import Tokenizer
from lorastream.worker.engine.engine import Engine
from lorastream.worker.loading.fetch import AdapterFetcher, FetchProcess, SharedHostMemory
from lorastream.worker.loading.manager import AdapterManager
from lorastream.worker.lora.backend import LoraBackend, TorchLoraBackend
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.checkpoint import resolve_checkpoint
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.kv_cache import KVCache
from lorastream.worker.model.weights import load_weights
from lorastream.worker.service.config import WorkerSettings

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"--device {spec}: CUDA is not available on this machine")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[spec]


def make_backend(name: str, dtype: torch.dtype, device: torch.device,
                 native: bool = False) -> LoraBackend:
    """``native``: the C++ CPU kernels are loaded (``--cpu-kernels``); the torch backend uses
    its LoRA op where a step allows."""
    if name == "torch":
        return TorchLoraBackend(dtype, device, native)
    if name == "triton":
        from lorastream.worker.lora.triton_backend import TritonLoraBackend

        return TritonLoraBackend(dtype, device)
    raise InvalidArgument(f"unknown --lora-backend {name!r}; use torch or triton")


def make_fetch_process(settings: WorkerSettings, device: Device,
                       store_tls: ClientTLS | None = None) -> FetchProcess | None:
    """The fetch process ``--fetch-process`` asks for, with the host budget as shared memory;
    None for fetches on the worker's own threads (off, no store, or no ``memfd`` here)."""
    if not settings.fetch_process or not settings.store:
        return None
    if not SharedHostMemory.supported():
        log.warning("no memfd_create on this platform: store fetches run in the worker")
        return None
    began = time.perf_counter()
    memory = SharedHostMemory(device, settings.host_cache_bytes, settings.host_memory_prefault)
    if settings.host_memory_prefault:
        log.info("host adapter memory: %.1f GiB taken and mapped in %.1f s",
                 settings.host_cache_bytes / 2**30, time.perf_counter() - began)
    return FetchProcess(memory, settings.store, settings.store_token,
                        threads=settings.fetch_threads, priority=settings.loader_priority_spec,
                        tls=store_tls)


def build_engine(settings: WorkerSettings, checkpoint: Path | None = None) -> Engine:
    """Load the base model and allocate every budget; the engine is not started."""
    started = time.perf_counter()
    store_tls = settings.store_client_tls()  # checked before the model loads: a typo fails at once
    torch_device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, torch_device)
    unsupported = quantization_unsupported(torch_device, settings.quantization)
    if unsupported is not None:  # before the checkpoint is fetched
        raise InvalidArgument(f"--quantization {settings.quantization}: {unsupported}")
    checkpoint = checkpoint or resolve_checkpoint(
        settings.model,
        cache_dir=settings.model_cache_dir,
        hf_endpoint=settings.hf_endpoint,
        hf_token=settings.hf_token,
    )
    # Config and every weight are checked before anything is allocated or started: a checkpoint
    # that disagrees with its config.json stops the worker here, naming the tensor.
    config = ModelConfig.from_dir(checkpoint, name=settings.base_model_name)
    weights = load_weights(checkpoint, config, dtype, torch_device)
    model = DecoderModel(config, weights, torch_device, quantization=settings.quantization,
                         cpu_kernels=settings.cpu_kernels)
    quantized = settings.quantization != "none"
    slow = (quantization_slow_here(torch_device, settings.quantization, model.native_ops)
            if quantized else None)
    if slow is not None:
        log.warning("--quantization %s: %s", settings.quantization, slow)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    device = Device(torch_device, loader_priority=settings.loader_priority_spec,
                    copy_turn_s=settings.copy_turn_ms / 1000,
                    fetch_turn_s=settings.fetch_turn_ms / 1000,
                    load_share=settings.load_share,
                    bind_compute=settings.bind_compute_threads)
    warning = starvation_warning(device.loader_priority, waits_actively())
    if warning and not device.is_cuda:
        log.warning(warning)
    kv = KVCache(
        config.num_layers, config.num_kv_heads, config.head_dim,
        settings.kv_cache_bytes, dtype, torch_device,
    )
    slots = LoraSlots(config, settings.max_loras, settings.max_lora_rank, dtype, torch_device,
                      base=model, vocab_bytes=settings.lora_vocab_bytes)
    fetcher = AdapterFetcher(
        device, settings.store, settings.store_token,
        make_fetch_process(settings, device, store_tls), store_tls,
    )
    adapters = AdapterManager(
        config, slots, device, fetcher, settings.host_cache_bytes,
        overlap=settings.lora_overlap_loading, layered=settings.layered_admission,
        fetch_threads=settings.fetch_threads,
        metrics=WorkerMetrics(picker_running=settings.picker_running),
        tokenizers=settings.adapter_tokenizer_cache,
    )
    engine = Engine(
        model,
        cast(Tokenizer, tokenizer),  # decode of a flat id list returns one str
        kv,
        slots,
        adapters,
        make_backend(settings.lora_backend, dtype, torch_device, model.native_ops),
        device,
        base_model_name=settings.base_model_name,
        max_batch_size=settings.max_batch_size,
        max_num_tokens=settings.max_num_tokens,
        max_seq_len=settings.max_seq_len,
        default_max_tokens=settings.default_max_tokens,
        prefetch_depth=settings.prefetch_depth,
        prefix_caching=settings.prefix_caching,
        max_mix_adapters=settings.max_mix_adapters,
    )
    log.info(
        "engine ready in %.1fs: %s (%s) on %s (%s), %d layers; KV cache %d tokens (%.0f MB); "
        "%d LoRA slots of rank <= %d (%.0f MB); backend %s; overlap loading %s",
        time.perf_counter() - started, settings.base_model_name, config.family, torch_device,
        str(dtype).removeprefix("torch."), config.num_layers, kv.capacity_tokens, kv.nbytes / 1e6,
        settings.max_loras, settings.max_lora_rank, slots.nbytes / 1e6, settings.lora_backend,
        "on" if settings.lora_overlap_loading else "off",
    )
    return engine
