"""What one generated token does to its sequence: the grammar accepts it, it joins the output,
the detokenizer turns it into text, and it may end the sequence (EOS or a stop token id, a stop
string, a complete grammar output, the length limit). The engine (``engine.py``) streams the
result or retires the sequence; nothing here touches the scheduler, the KV cache or the slots.
"""

from __future__ import annotations

import time

from lorastream.core.generation import FinishReason
from lorastream.worker.engine.sequence import Sequence


def take_token(seq: Sequence, token: int) -> tuple[FinishReason | None, str]:
    """Append ``token`` to ``seq``'s output; returns (why the sequence ends or None, the text
    to stream with the token). Raises InvalidArgument if the grammar refuses the token (the
    sampler masked it, so that is a bug: the caller fails the request, never streams it)."""
    if seq.matcher is not None:
        seq.matcher.accept(token)
    seq.output_ids.append(token)
    if seq.first_token_at is None:
        seq.first_token_at = time.perf_counter()
    if token in seq.eos_ids or token in seq.params.stop_token_ids:
        # The stop token is reported in token_ids but never rendered as text.
        return FinishReason.STOP, seq.detokenizer.flush()
    step = seq.detokenizer.push(token)
    if step.stopped:
        return FinishReason.STOP, step.delta
    if seq.matcher is not None and seq.matcher.finished:  # the output is complete
        return FinishReason.STOP, step.delta + seq.detokenizer.flush()
    if seq.length >= seq.max_len:
        return FinishReason.LENGTH, step.delta + seq.detokenizer.flush()
    return None, step.delta
