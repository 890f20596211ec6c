"""Activated LoRA (PEFT's ``alora_invocation_tokens``): where in a sequence the adapter's delta
starts.

PEFT (``peft.tuners.lora.variants.calculate_alora_offsets`` and ``ALoraLinearVariant``) searches
the **prompt** for the **last** occurrence of the adapter's invocation tokens, once, when
``generate`` starts. Rows from the start of that occurrence on (the invocation tokens included)
take the delta; rows before it run the base model. Every generated token takes the delta. A
prompt without the invocation sequence runs the base model throughout, generated tokens
included. Example, invocation ``[7, 8]``::

    prompt   5 7 8 3 7 8 9        generated  4 6 ...
    position 0 1 2 3 4 5 6                  7 8 ...
    delta    - - - - x x x                  x x ...      (start = 4, the last [7, 8])

Per sequence that is one number, the first position whose row takes the delta
(``Sequence.lora_from``): 0 for a plain LoRA; the rows before it get slot -1 in the step's LoRA
metadata (``step_inputs.py``), exactly as a base-model row, and their KV blocks are the base
model's (``prefix_cache.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

NEVER = 1 << 62  # lora_from of a prompt without the invocation sequence: no row takes the delta


def activation_start(prompt_ids: Sequence[int], invocation: Sequence[int]) -> int:
    """The first position whose row takes the adapter's delta: 0 for a plain LoRA (no
    ``invocation``), the start of the invocation's last occurrence in ``prompt_ids``, or
    :data:`NEVER` when it does not occur."""
    n = len(invocation)
    if n == 0:
        return 0
    first, want = invocation[0], list(invocation)
    for start in range(len(prompt_ids) - n, -1, -1):
        if prompt_ids[start] == first and list(prompt_ids[start : start + n]) == want:
            return start
    return NEVER
