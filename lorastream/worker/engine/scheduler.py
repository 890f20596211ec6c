"""Iteration-level scheduling: which sequences run in the next step, and how many tokens each.

Each step takes, within ``max_num_tokens`` tokens and ``max_batch_size`` sequences:
1. one decode token for every running sequence past its prompt;
2. the next prompt chunk of running sequences still prefilling (chunked prefill);
3. newly admitted waiting sequences, in arrival order, whose adapter is ready in a slot and
   whose whole KV reservation (prompt + max tokens) fits. A request whose adapter is still
   loading keeps its place and is skipped for now, so it never blocks the ones behind it
   (no head-of-line blocking); when its load lands it is first in line again (no starvation).
   A request that does not fit the KV cache stops admission, so big requests are not starved
   by small ones behind them. When a load the next waiting requests need will land sooner than
   the extra prefill step it would otherwise cost, new prefills are held for it (briefly; see
   ``device_tier.py``), so they are prefilled together.

With layer-ordered admission (``--layered-admission``, off by default), the scheduler holds a
``LayeredPrefills`` (``layered_prefill.py``) and asks it about a request whose adapter is still
landing: once its first layers are in a slot it takes its KV blocks and waits there while the
engine runs its prompt through the layers as they arrive; when the last one ran it joins
``running`` with one prompt token left, which the next step prefills. Off, ``layered`` is None.

Loads are started ahead of need: the first ``prefetch_depth`` waiting requests get their
adapters fetched and placed in free (or idle) slots while the batch keeps decoding.

With prefix caching (``prefix_cache.py``), an admitted sequence starts from the cached blocks of
its prompt's longest cached prefix (they count against the KV reservation like any other block;
only idle cached blocks are ever evicted for it), and the full blocks each step computed are
registered at the start of the next one.

A weighted mix (``Sequence.mix``) is admitted only once every one of its components is ready in
a slot (``AdapterManager.place_all``, which may evict adapters only requests behind it need);
it references all of them from submission to its end, so none is evicted while it runs.
Prefetch starts only single adapters' loads: a mix's components are fetched into host memory
from its submission and claim slots together.

Sequences carry only their adapter's id; every question about an adapter goes to the adapter
manager, which owns their state.
"""

from __future__ import annotations

import logging
from collections import deque

from lorastream.core.errors import LorastreamError
from lorastream.worker.engine.layered_prefill import LayeredPrefills
from lorastream.worker.engine.prefix_cache import PrefixCache
from lorastream.worker.engine.sequence import Sequence
from lorastream.worker.engine.step_inputs import StepPlan
from lorastream.worker.loading.manager import AdapterManager
from lorastream.worker.model.kv_cache import BlockAllocator

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        adapters: AdapterManager,
        *,
        max_batch_size: int,
        max_num_tokens: int,
        prefetch_depth: int,
        layered: LayeredPrefills | None = None,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.allocator = allocator
        self.prefix = prefix
        self.adapters = adapters
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.prefetch_depth = prefetch_depth
        self.layered = layered  # layer-ordered admission, None when off
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def landing(self) -> list[Sequence]:
        """Admitted while their adapter lands, prefilled layer by layer (layered admission)."""
        return [] if self.layered is None else self.layered.sequences

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.landing)

    def needs_load(self, seq: Sequence) -> bool:
        """Whether an adapter ``seq`` needs is not ready in a slot yet (never blocks)."""
        return any(not self.adapters.ready(adapter_id) for adapter_id in seq.adapter_ids)

    def waiting_on_loads(self) -> int:
        return sum(1 for seq in self.waiting if self.needs_load(seq))

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        if self.layered is not None:  # prompts cached but the last token: the batch takes them
            self.running.extend(self.layered.landed())
        if self.prefix is not None:  # the blocks computed by the last step are cached now
            for seq in self.running:
                self.prefix.commit(seq)
        budget = self.max_num_tokens
        for seq in self.running:
            if not seq.prefilling and budget > 0:
                plan.decode.append(seq)
                budget -= 1
        for seq in self.running:
            if seq.prefilling and budget > 0:
                chunk = min(seq.remaining_prompt, budget)
                plan.prefill.append((seq, chunk))
                budget -= chunk
        self._admit(plan, budget)
        self._prefetch()
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> None:
        next_adapters = [
            adapter_id for seq in list(self.waiting)[: self.prefetch_depth]
            for adapter_id in seq.adapter_ids
        ]
        if self.adapters.hold_for_loads(next_adapters):
            return
        admitted: list[Sequence] = []
        # adapters of the running requests and of the waiting ones looked at so far: a mix may
        # not evict them (AdapterManager.place_all)
        keep = {a for seq in [*self.running, *self.landing] for a in seq.adapter_ids}
        for seq in list(self.waiting):
            taken = len(self.running) + len(self.landing) + len(admitted)
            if budget <= 0 or taken >= self.max_batch_size:
                break
            lands: LayeredPrefills | None = None  # admitted while its adapter lands
            keep.update(seq.adapter_ids)
            if seq.adapter_ids:
                try:
                    placed = self.adapters.place_all(seq.adapter_ids, keep)
                    if not placed and self.layered is not None and self.layered.admits(seq):
                        lands = self.layered
                except LorastreamError as err:  # its adapter cannot be loaded (rule 5)
                    plan.failed.append((seq, err))
                    self.waiting.remove(seq)
                    continue
                if not placed and lands is None:
                    continue  # still loading: keep its place, look at the next one
            # cached prefix blocks (none for a layered landing: it writes its whole prompt)
            reused = self.prefix.match(seq) if self.prefix is not None and lands is None else []
            if not self.allocator.can_allocate(seq.reserve_tokens, reused):
                break  # wait for finishing sequences to free blocks
            # n > 1: every choice's blocks
            seq.blocks = self.allocator.allocate(seq.reserve_tokens, reused)
            if self.prefix is not None:
                self.prefix.admitted(seq, len(reused))
            if lands is not None:
                lands.take(seq)
                self.waiting.remove(seq)
                continue
            chunk = min(seq.remaining_prompt, budget)
            plan.prefill.append((seq, chunk))
            budget -= chunk
            admitted.append(seq)
            self.waiting.remove(seq)
        self.running.extend(admitted)

    def _prefetch(self) -> None:
        """Start loads for the adapters of the next waiting requests (bounded by slots)."""
        if self.prefetch_depth:
            self.adapters.prefetch(
                (seq.adapter_id for seq in self.waiting if seq.adapter_id is not None),
                self.prefetch_depth,
            )

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out (running or waiting) and free its blocks. The engine releases refs."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif self.layered is not None:
            self.layered.drop(seq)
        if seq.blocks:
            if self.prefix is not None:  # what its last step computed stays cached
                self.prefix.commit(seq)
            self.allocator.free(seq.blocks)
            seq.blocks = []
