"""Layer-ordered admission, the engine's side (``--layered-admission``, off by default;
docs/design.md, "Layer-ordered admission"): prefills that start while their adapter's layers
are still landing.

The engine holds a :class:`LayeredPrefills` only with the setting on (the adapter manager's
``layered``), and so does the scheduler; without it they hold None and nothing here runs. The
scheduler asks it whether a request whose adapter is not ready may be admitted already
(:meth:`LayeredPrefills.admits`: once the adapter's first layers are in a slot, which the
manager's ``place_layered`` fills layer by layer as the store's stream lands them), hands it the
request with its KV blocks (:meth:`LayeredPrefills.take`) and takes it back into the batch when
its prompt but the last token is cached (:meth:`LayeredPrefills.landed`).

After each scheduling round the engine calls :meth:`LayeredPrefills.advance`: each landing
request's prompt but the last token runs through the layers whose copies have completed, and the
hidden states are kept for the next round. Example, 30 layers, a prompt of 40 tokens: rounds that
find 4, 4, 11 and 30 layers ready run layers 0-3, none, 4-10 and 11-29 over tokens 0-38. Then the
cache holds the prompt but its last token, and the sequence joins the batch as an ordinary
prefilling sequence with one token left: the next step samples its first token as for any
request (logprobs, grammars, n > 1 unchanged).

Decode steps never wait for a layer: this runs between them, as far as the landed layers allow,
and a round runs at most a full step's worth of token-layers (``max_num_tokens`` tokens through
every layer), so a long prompt goes on over several rounds.
Each span is one batch of one sequence; it reads only layers whose own copy completed, and its
read of the slot is recorded like a step's (rule 2).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lorastream.core.errors import LorastreamError
from lorastream.worker.engine.sequence import Sequence
from lorastream.worker.engine.step_inputs import StepPlan, build_step_inputs
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


@dataclass(eq=False)
class _Landing:
    """A request admitted while its adapter lands, and how far its prefill got."""

    seq: Sequence
    layers: int = 0  # layers of its prompt run so far
    hidden: torch.Tensor | None = None  # their output, [len(prompt) - 1, H], until the last ran


class LayeredPrefills:
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
        self._landing: list[_Landing] = []  # admitted, prefilled layer by layer as they land
        self.layers_run = 0  # layer spans' layers, summed over sequences
        self.early_layers = 0  # of those, run while the adapter had not landed whole
        self.spans = 0  # spans run (one sequence, consecutive layers, one round)

    # -- the scheduler's questions --------------------------------------------------------------
    @property
    def sequences(self) -> list[Sequence]:
        """The requests admitted while their adapter lands, not in the batch yet."""
        return [landing.seq for landing in self._landing]

    def admits(self, seq: Sequence) -> bool:
        """Admit ``seq``, whose adapter ``AdapterManager.place`` found not ready, while it still
        lands? Once its first layers are in a slot, for a prompt of more than one token (the
        last one is prefilled in the batch, which samples the first token). Raises the adapter's
        error when it cannot be loaded."""
        return (len(seq.prompt_ids) > 1 and seq.adapter_id is not None
                and self.adapters.place_layered(seq.adapter_id) > 0)

    def take(self, seq: Sequence) -> None:
        """``seq`` is admitted (its KV blocks taken): its prefill runs here as layers land."""
        self._landing.append(_Landing(seq))

    def landed(self) -> list[Sequence]:
        """The requests whose prompt but the last token is cached, handed back for the batch."""
        done = [landing.seq for landing in self._landing if self._done(landing.seq)]
        self._landing = [landing for landing in self._landing if not self._done(landing.seq)]
        return done

    def drop(self, seq: Sequence) -> None:
        """``seq`` finished, failed or was cancelled: forget it (its blocks are the scheduler's)."""
        self._landing = [landing for landing in self._landing if landing.seq is not seq]

    # -- the engine's round ---------------------------------------------------------------------
    def advance(self) -> list[tuple[Sequence, LorastreamError]]:
        """Run each landing sequence's prompt (but its last token) through the layers now ready;
        the sequences whose adapter failed, with its error (rule 5: they fail with it)."""
        failed: list[tuple[Sequence, LorastreamError]] = []
        num_layers = self.slots.num_layers
        for landing in list(self._landing):
            seq = landing.seq
            if self._done(seq):
                continue
            assert seq.adapter_id is not None, "only adapter requests land layer by layer"
            try:
                ready = self.adapters.layers_ready(seq.adapter_id)
            except LorastreamError as err:
                failed.append((seq, err))
                continue
            if ready <= landing.layers:
                continue
            landed_whole = ready == num_layers
            ready = round_stop(landing.layers, ready, len(seq.prompt_ids) - 1,
                               self.max_num_tokens, num_layers)
            self._run(landing, ready)
            self.spans += 1
            if not landed_whole:
                self.early_layers += ready - landing.layers
            self.layers_run += ready - landing.layers
            landing.layers = ready
            if ready == num_layers:
                seq.num_computed = len(seq.prompt_ids) - 1
                landing.hidden = None
        return failed

    @staticmethod
    def _done(seq: Sequence) -> bool:
        """Its prompt but the last token is cached: it may join the batch."""
        return seq.num_computed >= len(seq.prompt_ids) - 1

    def _run(self, landing: _Landing, stop: int) -> None:
        """Layers ``landing.layers .. stop - 1`` over its prompt but the last token."""
        seq = landing.seq
        assert seq.adapter_id is not None
        # its slot, its copy still running; the read recorded however the span ends (rule 2)
        with self.adapters.landing_step(seq.adapter_id) as step:
            seq.slot = step.slots[0]
            chunk = len(seq.prompt_ids) - 1
            inputs = build_step_inputs(StepPlan(prefill=[(seq, chunk)]), None)
            batch = inputs.batch.to(self.model.device)
            lora = LoraStep.for_step(self.slots, self.backend, inputs.token_slots,
                                     self.model.dtype, self.model.device,
                                     logit_rows=inputs.logit_rows)
            start = landing.layers
            x = self.model.embed(batch, lora) if start == 0 else landing.hidden  # [n, H]
            assert x is not None
            landing.hidden = self.model.run_layers(x, batch, self.kv, lora, start, stop)
        log.debug("request %s: layers %d-%d of its prefill ran while its adapter lands",
                  seq.request_id, start, stop - 1)
