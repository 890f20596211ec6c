"""The tokenizer an adapter ships with: which files make it, what it must agree with.

An adapter trained with new tokens (PEFT's TrainableTokens, a resized or saved embedding) is
saved beside the tokenizer that knows them: ``tokenizer.json`` and its companions
(:data:`TOKENIZER_FILES`), and a ``generation_config.json`` whose ``eos_token_id`` names its stop
ids (a new end-of-turn token). The store keeps these files with the adapter, in its content id, and
lists them in the manifest (:class:`~lorastream.core.manifest.AdapterFile`, sha256 each); a
worker encodes that adapter's prompts and decodes its output with it.

The rule (no mismatched vocabularies): every id the adapter's tokenizer can produce must be a
row of the base model's embedding. ``tokenizer_vocab`` (its highest id + 1) may exceed the base
*tokenizer* -- Qwen2.5's embedding has 151,936 rows for ~151,665 tokens, so added tokens land on
rows the base already has, which TrainableTokens then trains -- but not the embedding: a grown
vocabulary is refused, by the store when the adapter's own tensors tell the vocabulary (a saved
or LoRA-adapted embedding) and by every worker and gateway against its base (``adapter_fit``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from lorastream.core.errors import InvalidAdapter

TOKENIZER_JSON = "tokenizer.json"
# Its stop ids (eos_token_id), which travel with the tokenizer: kept only beside one.
GENERATION_CONFIG = "generation_config.json"
# The files of a fast tokenizer and its generation config, in the order the content id hashes
# them (after the adapter's config and weights); tokenizer.json is required when any is present.
TOKENIZER_FILES = (TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", GENERATION_CONFIG)
_HASH_CHUNK = 1 << 20


def tokenizer_files(names: set[str] | list[str]) -> tuple[str, ...]:
    """The tokenizer files among ``names``, in :data:`TOKENIZER_FILES` order; a generation
    config alone is none (an adapter saved beside one, without a tokenizer, stays as it was)."""
    found = tuple(n for n in TOKENIZER_FILES if n in names)
    return () if found == (GENERATION_CONFIG,) else found


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_vocab(directory: Path, label: str) -> int:
    """The adapter tokenizer's highest token id + 1 (its added tokens included); InvalidAdapter
    when its files do not make a tokenizer."""
    names = tokenizer_files([p.name for p in directory.iterdir()])
    if TOKENIZER_JSON not in names:
        raise InvalidAdapter(
            f"{label}: it ships tokenizer files ({', '.join(names)}) without {TOKENIZER_JSON}; "
            f"save the adapter's tokenizer with a fast tokenizer (tokenizer.save_pretrained)")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as err:  # any parse failure is the adapter's fault
        raise InvalidAdapter(f"{label}: its tokenizer does not load ({err})") from err
    return max(tokenizer.get_vocab().values()) + 1


def vocab_refusal(tokens: int, rows: int, where: str) -> str:
    """The message refusing a tokenizer of ``tokens`` ids over an embedding of ``rows`` rows."""
    return (f"its tokenizer has {tokens} token ids but {where} has {rows} embedding rows (a "
            "mismatched vocabulary is not supported: an adapter's tokenizer may add tokens only "
            "on ids the base model's embedding has)")
