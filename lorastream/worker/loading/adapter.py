"""One adapter as the worker knows it, across tiers: the adapter manager's record.

Only ``loading/`` reads it, and only its own methods write its fields (the manager and the tiers
call them, under the manager's lock); the rest of the worker holds adapter ids and asks the
manager (``tests/worker/loading/test_adapter_state_owned.py`` checks both).

Check an adapter against this worker's base model before it can reach a slot
(docs/design.md rule 6).

The store already checked the adapter on its own (PEFT format, A/B pairs, ranks); here we check
it fits *this* base model and *this* worker: every tensor names a layer the model has and a
projection it adapts, with ``A [r, in]`` and ``B [out, r]`` (and DoRA's magnitude ``[out]``) of
the model's sizes, and a rank within ``--max-lora-rank``. Checksums were verified while the
bytes landed.

What the adapter manager tells the rest of the worker about its adapters, as plain values.

Nothing outside ``loading/`` holds an :class:`AdapterEntry`: the operator calls get an
:class:`AdapterStatus` per name, the stats and the metrics a :class:`TierUsage`, and tests an
:class:`AdapterSnapshot` of one adapter's internals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lorastream.core.adapter_fit import (
    expected_shape,
    expert_misfit,
    expert_names,
    tensor_kind,
    vocab_misfit,
)
from lorastream.core.adapter_format import (
    MAGNITUDE,
    fused_depth,
    lora_parameter,
    parse_lora_key,
    parse_vocab_key,
    per_expert,
)
from lorastream.core.errors import InvalidAdapter, LorastreamError
from lorastream.core.generation import AdapterStatus
from lorastream.core.manifest import AdapterManifest
from lorastream.worker.device.device import Event
from lorastream.worker.loading.load_timeline import LoadTimeline
from lorastream.worker.lora.vocab import TOKEN_IDS, VocabBudget
from lorastream.worker.model.config import ModelConfig

if TYPE_CHECKING:
    from lorastream.worker.loading.host import HostAdapterBuffer


class Residency(Enum):
    REMOTE = "remote"  # known, tensors only in the store
    LOADING = "loading"  # being fetched to host or copied to a slot
    HOST = "host"
    DEVICE = "device"


@dataclass
class AdapterEntry:
    adapter_id: str
    name: str
    manifest: AdapterManifest
    local_path: Path | None = None
    weights: AdapterWeights | None = None  # host tier
    host_bytes: int = 0  # reserved against the host budget (set when the fetch begins)
    host_offset: int | None = None  # its range in the host arena; None: allocated on its own
    fetching: bool = False
    # Leading layers landed in host memory, verified, per the manifest's own layer count
    # (layer_progress.manifest_layers): grows while the fetch runs, that count once the weights
    # are set, 0 when a fetch starts or fails.
    layers_landed: int = 0
    error: LorastreamError | None = None
    slot: int | None = None
    slot_event: Event | None = None  # completion of the copy into ``slot``
    refs: int = 0
    pinned: bool = False
    last_used: float = field(default_factory=time.monotonic)
    fetch_started: float = 0.0  # perf_counter when the store fetch began
    copy_started: float = 0.0  # perf_counter when the copy into ``slot`` was submitted
    # a request found it off the device: where that request's wait goes (load_timeline.py)
    load: LoadTimeline | None = None

    @property
    def residency(self) -> Residency:
        if self.slot is not None:
            event = self.slot_event
            return Residency.DEVICE if event is None or event.query() else Residency.LOADING
        if self.fetching:
            return Residency.LOADING
        return Residency.HOST if self.weights is not None else Residency.REMOTE

    @property
    def copying(self) -> bool:
        """A copy from its host buffer into a slot is still in flight."""
        return self.slot_event is not None and not self.slot_event.query()

    # -- the only writers of its fields (tests/worker/loading/test_adapter_state_owned.py checks) --
    def acquire(self) -> None:
        """A queued request (or an operator's load) needs it; a new one retries a failed load."""
        if self.refs == 0:
            self.error = None
        self.refs += 1
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.refs -= 1
        assert self.refs >= 0, f"reference count of {self.name} went negative"
        self.last_used = time.monotonic()

    def pin(self) -> None:
        self.pinned = True

    def unpin(self) -> None:
        self.pinned = False

    def rename(self, name: str) -> None:
        """Fetch it by ``name`` from now on (the name it was known by was unloaded)."""
        self.name = name

    def register_local(self, path: Path, pin: bool) -> None:
        """Registered from a local directory: never fetched from the store."""
        self.local_path = path
        self.pinned = self.pinned or pin

    def fail(self, error: LorastreamError) -> None:
        self.error = error

    def reserve_host(self, nbytes: int, offset: int | None) -> None:
        """``nbytes`` of the host budget are its, at ``offset`` of the arena (None: its own)."""
        self.host_bytes, self.host_offset = nbytes, offset

    def drop_host(self) -> None:
        """Its host copy (or reservation) is gone."""
        self.weights, self.host_bytes, self.host_offset = None, 0, None
        self.layers_landed = 0

    def begin_fetch(self) -> None:
        self.fetching = True
        self.layers_landed = 0
        self.fetch_started = time.perf_counter()

    def land_layers(self, count: int) -> bool:
        """The fetch reports ``count`` leading layers landed, verified; True when that is news."""
        if not self.fetching or count <= self.layers_landed:
            return False
        self.layers_landed = count
        return True

    def land(self, weights: AdapterWeights, layers: int) -> None:
        """Its checked host copy (``layers``: the manifest's layer count)."""
        self.weights = weights
        self.layers_landed = layers

    def end_fetch(self) -> None:
        self.fetching = False

    def take_slot(self, slot: int) -> None:
        """``slot`` is its; the copy into it is submitted next (:meth:`copy_submitted`)."""
        self.slot = slot
        self.copy_started = time.perf_counter()

    def copy_submitted(self, event: Event) -> None:
        self.slot_event = event

    def time_load(self, requested: float | None = None) -> None:
        """A request found it off the device: time its wait from ``requested`` (perf_counter,
        before its name was resolved; default now), unless a wait is timed already."""
        if self.load is None or self.load.copied:  # none yet, or one left unclosed
            self.load = LoadTimeline.now()
            if requested is not None:
                self.load.requested, self.load.resolved = requested, self.load.requested

    def end_load_timing(self) -> LoadTimeline | None:
        """Its waiting request is admitted (or an operator's load is done): the timeline."""
        timeline, self.load = self.load, None
        return timeline

    def leave_slot(self) -> None:
        self.slot, self.slot_event = None, None


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter's tensors in host memory, mapped to (layer, module, A|B|M), ready for a slot
    (M: DoRA's magnitude vectors, ``[n_layers, out]`` blocks)."""

    adapter_id: str
    name: str
    rank: int
    scaling: float
    # (first layer, module, "A"|"B"|"M", block [n_layers, *shape]): zero-copy views of the host
    # buffer
    blocks: tuple[tuple[int, str, str, torch.Tensor], ...]
    nbytes: int
    # (layer, module, its scaling / ``scaling``) of the modules of their own scaling (PEFT's
    # rank_pattern / alpha_pattern), folded into their B when placed (lora/slots.py)
    folds: tuple[tuple[int, str, float], ...] = ()


def check_fits(manifest: AdapterManifest, config: ModelConfig, max_rank: int,
               vocab_budget: VocabBudget | None = None) -> dict[str, str]:
    """InvalidAdapter unless ``manifest`` fits the base model and the slot capacity (its rank,
    and with ``vocab_budget`` its vocabulary modules' bytes); returns the names of its fused
    expert modules (``experts`` -> ``experts.down_proj``, see ``core/adapter_format.py``).

    The adaptable modules and their sizes come from the base model's family (e.g. Phi-3 adapts
    the fused qkv_proj and gate_up_proj, not q_proj); a wrong target names the family and what
    it accepts. An expert LoRA must match the experts' count, widths and the adapter's rank
    (``core/adapter_fit.py``).
    """
    label = f"adapter {manifest.name}"
    if manifest.rank > max_rank:
        raise InvalidAdapter(
            f"{label} has rank {manifest.rank}, above this worker's --max-lora-rank {max_rank}; "
            "start the worker with a larger --max-lora-rank"
        )
    shapes = config.module_shapes()
    base = config.describe()
    experts = config.expert_shape()
    names = expert_names(manifest, experts) if experts is not None else {}
    reason = vocab_misfit(manifest, config.vocab_size, config.hidden_size)
    if reason is not None:
        raise InvalidAdapter(f"{label} does not fit {base}: {reason}")
    need = vocab_budget.need(manifest) if vocab_budget is not None else 0
    if vocab_budget is not None and need > vocab_budget.nbytes:
        raise InvalidAdapter(
            f"{label}'s vocabulary modules (new token rows, embed_tokens / lm_head LoRA or saved "
            f"modules) take {need} bytes on the device, above this worker's --lora-vocab-bytes "
            f"{vocab_budget.nbytes}; start the worker with a larger --lora-vocab-bytes"
        )
    for info in manifest.tensors:
        if parse_vocab_key(info.name) is not None:  # vocab_misfit's, above
            continue
        key = parse_lora_key(info.name)
        if key is not None and (per_expert(key.module) or fused_depth(key.module) is not None):
            reason = expert_misfit(manifest, info, key.module, key.layer, key.ab, experts, names)
            if reason is not None:
                raise InvalidAdapter(f"{label} does not fit {base}: {reason}")
            continue
        if key is None or key.module not in shapes:
            module = key.module if key is not None else info.name
            raise InvalidAdapter(
                f"{label}: tensor {info.name} targets {module}, which {base} does not have; "
                f"its adaptable modules are {', '.join(shapes)} (train the adapter for this "
                "base model, with target_modules among them)"
            )
        if key.layer >= config.num_layers:
            raise InvalidAdapter(
                f"{label} was trained for a different base model: it adapts layer {key.layer}, "
                f"but {base} has {config.num_layers} layers"
            )
        fan_in, fan_out = shapes[key.module]
        rank = manifest.module_rank(info.name, lora_parameter(key.module, names))
        expected = expected_shape(key.ab, rank, fan_in, fan_out)
        if tuple(info.shape) != expected:
            raise InvalidAdapter(
                f"{label} was trained for a different base model: layer {key.layer} "
                f"{key.module} {tensor_kind(key.ab)} is {list(info.shape)}, but {base} needs "
                f"{list(expected)} ({key.module} maps {fan_in} -> {fan_out} features)"
            )
    _check_dora_complete(manifest, label)
    outside = [t for t in manifest.alora_invocation_tokens if t >= config.vocab_size]
    if outside:
        raise InvalidAdapter(
            f"{label} is an activated LoRA whose alora_invocation_tokens {outside[:5]} lie "
            f"outside {base}'s vocabulary (0..{config.vocab_size - 1}); tokenize its invocation "
            "string with this base model's tokenizer"
        )
    return names


def _check_dora_complete(manifest: AdapterManifest, label: str) -> None:
    """A DoRA adapter (one with magnitude vectors) has one for every module it adapts: a slot
    applies DoRA's factor to all of them (``LoraSlots``)."""
    kinds: dict[tuple[int, str], set[str]] = {}
    for info in manifest.tensors:
        key = parse_lora_key(info.name)
        if key is not None and not (per_expert(key.module) or fused_depth(key.module) is not None):
            kinds.setdefault((key.layer, key.module), set()).add(key.ab)
    if not any(MAGNITUDE in k for k in kinds.values()):
        return
    for (layer, module), k in sorted(kinds.items()):
        if MAGNITUDE not in k:
            raise InvalidAdapter(
                f"{label} is a DoRA adapter but layer {layer} {module} has no "
                "lora_magnitude_vector (re-save it with PEFT)"
            )


def adapter_weights(
    buffer: HostAdapterBuffer, config: ModelConfig, max_rank: int,
    vocab_budget: VocabBudget | None = None,
) -> AdapterWeights:
    """Check the adapter in ``buffer`` (:func:`check_fits`) and map it, in as few blocks as its
    layout allows, for :meth:`LoraSlots.write`."""
    manifest = buffer.manifest
    assert manifest is not None, "the buffer holds no adapter"
    names = check_fits(manifest, config, max_rank, vocab_budget)
    blocks = tuple((layer, names.get(module, module), ab, block)
                   for module, ab, layer, block in buffer.groups())
    if manifest.token_indices:  # the ids of its new embedding rows travel as one more block
        ids = torch.tensor([manifest.token_indices], dtype=torch.long)  # [1, k]
        blocks += ((0, "embed_tokens", TOKEN_IDS, ids),)
    return AdapterWeights(
        adapter_id=manifest.adapter_id,
        name=manifest.name,
        rank=manifest.rank,
        scaling=manifest.scaling,
        blocks=blocks,
        nbytes=manifest.total_bytes,
        folds=folds(manifest, names),
    )


def folds(manifest: AdapterManifest, names: dict[str, str]) -> tuple[tuple[int, str, float], ...]:
    """(layer, module as the blocks name it, ratio) of each module whose scaling is not the
    adapter's one (``AdapterManifest.module_scaling``); () for an adapter without patterns."""
    if not manifest.rank_pattern and not manifest.alpha_pattern:
        return ()
    found: list[tuple[int, str, float]] = []
    for info in manifest.tensors:
        vocab = parse_vocab_key(info.name)
        key = parse_lora_key(info.name) if vocab is None else None
        if vocab is not None and vocab.kind == "B":
            layer, module, parameter = 0, vocab.module, None
        elif key is not None and key.ab == "B":
            layer, module = key.layer, names.get(key.module, key.module)
            parameter = lora_parameter(key.module, names) if per_expert(key.module) is None \
                else None
        else:
            continue
        ratio = manifest.module_scaling(info.name, parameter) / manifest.scaling
        if ratio != 1.0:
            found.append((layer, module, ratio))
    return tuple(found)


@dataclass(frozen=True)
class TierUsage:
    """The host and device tiers at one moment."""

    resident: dict[str, int]  # tier ("host", "device") -> adapters
    resident_bytes: dict[str, int]  # tier -> bytes
    loading: int  # adapters being fetched into host memory or copied into a slot
    slots_used: int  # slots holding (or being loaded with) an adapter
    host_bytes_used: int  # reserved against the host budget
    host_bytes_budget: int
    references: int  # queued and running requests (and operator loads) holding adapters


@dataclass(frozen=True)
class AdapterSnapshot:
    """One adapter's state inside the manager (for tests and debugging)."""

    name: str
    adapter_id: str
    residency: str  # "remote" | "loading" | "host" | "device"
    references: int
    slot: int | None
    fetching: bool
    on_host: bool  # its checked host copy is present
    host_offset: int | None  # its range in the host arena; None: none, or allocated on its own
    host_bytes: int
    error: str | None
    block_addresses: tuple[int, ...]  # data pointers of its host blocks


def adapter_status(name: str, entry: AdapterEntry) -> AdapterStatus:
    return AdapterStatus(
        name=name,
        adapter_id=entry.adapter_id,
        residency=entry.residency.value,
        rank=entry.manifest.rank,
        nbytes=entry.manifest.total_bytes,
        pinned=entry.pinned,
        references=entry.refs,
        slot=-1 if entry.slot is None else entry.slot,
    )


def adapter_statuses(
    entries: Iterable[AdapterEntry], names_of: Callable[[str], list[str]]
) -> list[AdapterStatus]:
    """One status per name (``names_of(adapter_id)``: its names, sorted), ordered by the
    adapters' names; an adapter no name maps to any more is listed under its own."""
    statuses: list[AdapterStatus] = []
    for entry in sorted(entries, key=lambda e: e.name):
        own = names_of(entry.adapter_id)
        statuses.extend(adapter_status(n, entry) for n in own or [entry.name])
    return statuses


def snapshot(entry: AdapterEntry) -> AdapterSnapshot:
    weights = entry.weights
    return AdapterSnapshot(
        name=entry.name,
        adapter_id=entry.adapter_id,
        residency=entry.residency.value,
        references=entry.refs,
        slot=entry.slot,
        fetching=entry.fetching,
        on_host=weights is not None,
        host_offset=entry.host_offset,
        host_bytes=entry.host_bytes,
        error=None if entry.error is None else str(entry.error),
        block_addresses=(
            () if weights is None else tuple(block.data_ptr() for *_, block in weights.blocks)
        ),
    )


def tier_usage(entries: Iterable[AdapterEntry], host_budget: int) -> TierUsage:
    entries = list(entries)
    on_host = [e for e in entries if e.weights is not None]
    residencies = [e.residency for e in entries]
    on_device = [e for e, r in zip(entries, residencies, strict=True) if r is Residency.DEVICE]
    return TierUsage(
        resident={"host": len(on_host), "device": len(on_device)},
        resident_bytes={"host": sum(e.host_bytes for e in on_host),
                        "device": sum(e.manifest.total_bytes for e in on_device)},
        loading=sum(1 for r in residencies if r is Residency.LOADING),
        slots_used=sum(1 for e in entries if e.slot is not None),
        host_bytes_used=sum(e.host_bytes for e in entries),
        host_bytes_budget=host_budget,
        references=sum(e.refs for e in entries),
    )
