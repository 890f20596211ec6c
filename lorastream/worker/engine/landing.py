"""Prefills that start while their adapter's layers are still landing (``--layered-admission``;
docs/design.md, "Layer-ordered admission").

A request admitted that way sits in ``Scheduler.landing``: it holds its KV blocks, and its
adapter a slot that fills layer by layer as the store's stream lands them
(``loading/layered.py``). After each scheduling round the engine runs its prompt but
the last token through the layers whose copies have completed, and keeps the hidden states on
the sequence for the next round. Example, 30 layers, a prompt of 40 tokens: rounds that find 4,
4, 11 and 30 layers ready run layers 0-3, none, 4-10 and 11-29 over tokens 0-38. Then the cache
holds the prompt but its last token, and the sequence joins the batch as an ordinary prefilling
sequence with one token left: the next step samples its first token as for any request
(logprobs, grammars, n > 1 unchanged).

Decode steps never wait for a layer: this runs between them, as far as the landed layers allow,
and a round runs at most a full step's worth of token-layers (``max_num_tokens`` tokens through
every layer), so a long prompt goes on over several rounds.
Each span is one batch of one sequence; it reads only layers whose own copy completed, and its
read of the slot is recorded like a step's (rule 2).
"""

from __future__ import annotations

import logging

from lorastream.core.errors import LorastreamError
from lorastream.worker.engine.scheduler import StepPlan
from lorastream.worker.engine.sequence import Sequence
from lorastream.worker.engine.step_inputs import build_step_inputs
from lorastream.worker.loading.manager import AdapterManager
from lorastream.worker.lora.backend import LoraBackend, LoraStep
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.decoder import DecoderModel
from lorastream.worker.model.kv_cache import KVCache

log = logging.getLogger(__name__)


def round_stop(done: int, ready: int, tokens: int, max_num_tokens: int, num_layers: int) -> int:
    """The layer a round runs up to: ``ready``, but at most a full step's token-layers
    (``max_num_tokens`` through ``num_layers``) over ``tokens``, and at least one layer.
    Example: 30 layers, ``max_num_tokens`` 2048, a 4000-token prompt: 15 layers a round."""
    return min(ready, done + max(1, max_num_tokens * num_layers // max(tokens, 1)))


class LandingPrefills:
    def __init__(self, model: DecoderModel, kv: KVCache, slots: LoraSlots,
                 backend: LoraBackend, adapters: AdapterManager, max_num_tokens: int) -> None:
        """``max_num_tokens``: a round runs at most the token-layers of a full step's worth
        (``max_num_tokens`` tokens through every layer), so a long prompt's layers, landed all
        at once, do not hold the running streams for longer than a step would."""
        self.model = model
        self.max_num_tokens = max_num_tokens
        self.kv = kv
        self.slots = slots
        self.backend = backend
        self.adapters = adapters
        self.layers_run = 0  # layer spans' layers, summed over sequences
        self.early_layers = 0  # of those, run while the adapter had not landed whole
        self.spans = 0  # spans run (one sequence, consecutive layers, one round)

    @staticmethod
    def done(seq: Sequence) -> bool:
        """Its prompt but the last token is cached: it may join the batch."""
        return seq.num_computed >= len(seq.prompt_ids) - 1

    def advance(self, landing: list[Sequence]) -> list[tuple[Sequence, LorastreamError]]:
        """Run each landing sequence's prompt (but its last token) through the layers now ready;
        the sequences whose adapter failed, with its error (rule 5: they fail with it)."""
        failed: list[tuple[Sequence, LorastreamError]] = []
        num_layers = self.slots.num_layers
        for seq in landing:
            if self.done(seq):
                continue
            assert seq.adapter_id is not None, "only adapter requests land layer by layer"
            try:
                ready = self.adapters.layers_ready(seq.adapter_id)
            except LorastreamError as err:
                failed.append((seq, err))
                continue
            if ready <= seq.landing_layers:
                continue
            landed_whole = ready == num_layers
            ready = round_stop(seq.landing_layers, ready, len(seq.prompt_ids) - 1,
                               self.max_num_tokens, num_layers)
            self._run(seq, ready)
            self.spans += 1
            if not landed_whole:
                self.early_layers += ready - seq.landing_layers
            self.layers_run += ready - seq.landing_layers
            seq.landing_layers = ready
            if ready == num_layers:
                seq.num_computed = len(seq.prompt_ids) - 1
                seq.landing_hidden = None
        return failed

    def _run(self, seq: Sequence, stop: int) -> None:
        """Layers ``seq.landing_layers .. stop - 1`` over its prompt but the last token."""
        assert seq.adapter_id is not None
        # its slot, its copy still running; the read recorded however the span ends (rule 2)
        with self.adapters.landing_step(seq.adapter_id) as step:
            seq.slot = step.slots[0]
            chunk = len(seq.prompt_ids) - 1
            inputs = build_step_inputs(StepPlan(prefill=[(seq, chunk)]), None)
            batch = inputs.batch.to(self.model.device)
            lora = LoraStep.for_step(self.slots, self.backend, inputs.token_slots,
                                     self.model.dtype, self.model.device)
            start = seq.landing_layers
            x = self.model.embed(batch) if start == 0 else seq.landing_hidden  # [n, H]
            assert x is not None
            seq.landing_hidden = self.model.run_layers(x, batch, self.kv, lora, start, stop)
        log.debug("request %s: layers %d-%d of its prefill ran while its adapter lands",
                  seq.request_id, start, stop - 1)
