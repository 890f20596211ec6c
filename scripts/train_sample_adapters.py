"""Train the sample adapters `lorastream up` registers: "shout" (answers in UPPER CASE) and
"french" (answers in French), small PEFT LoRAs on the default model (SmolLM2-135M-Instruct).

Usage:
    python scripts/train_sample_adapters.py       # both, into lorastream/samples/adapters
    python scripts/train_sample_adapters.py --which french --steps 300 --seed 0
    python scripts/train_sample_adapters.py --model CHECKPOINT_DIR ...       # another base
    python scripts/train_sample_adapters.py --model qwen2.5-coder-0.5b --which french \
        --steps 40 --targets q_proj,k_proj,v_proj,o_proj   # into .../french-qwen2.5-coder-0.5b
    python scripts/train_sample_adapters.py --which french --kind alora --steps 40 --rank 4
        # an activated LoRA, into .../french-alora (--kind: see KINDS; --dora = --kind dora)

Data, deterministic from --seed: English questions from the templates x slots in
lorastream/samples/dataset_templates.json (capitals, greetings, colours, arithmetic, numbers,
animals, how-tos, facts, calendar, chit-chat, topics); its "held_out" questions never appear in
training and serve as the base-vs-adapter samples. The answers differ per adapter:

    shout:  the base model's own greedy answer (<= --answer-tokens), cut to its last full
            sentence and upper-cased, so the adapter learns "same content, UPPER CASE";
    french: a templated French answer per question family (the 135M base cannot translate).

--model is "default", another embedded model the worker knows with a chat template
("qwen2.5-coder-0.5b": its adapters go under <name>-<model>), or an HF checkpoint directory.

--kind chooses what PEFT trains (saved under <name>-<kind>; "plain" under <name>):

    plain:         a LoRA on q/k/v/o/gate/up/down (--targets to choose; no bias);
    dora:          the same with use_dora (magnitude vectors beside A and B);
    tokens:        a LoRA on q/v and new rows for two rare tokens (trainable_token_indices):
                   the prompt ends with the first (the cue), the answer with the second;
    embed-lora:    a LoRA on embed_tokens (and q/v);
    head-lora:     a LoRA on lm_head (and q/v);
    saved-modules: a LoRA on q/v and a whole trained copy of lm_head (modules_to_save);
    alora:         an activated LoRA (alora_invocation_tokens): the prompt's assistant turn
                   opens with INVOCATION instead, and only from there on is the adapter active,
                   so a prompt without it is the base model's.

Training: AdamW with linear warm-up and decay, batches of padded chat-template examples, loss
only on the assistant tokens (the answer and <|im_end|>). Output per adapter under --out/<name>/:
adapter_config.json, adapter_model.safetensors (fp16), training.json (settings, loss, time,
versions, base-vs-adapter samples on held-out questions) and dataset.jsonl.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file: make the repository importable
    sys.path.insert(0, str(ROOT))

from lorastream.bench.peft_peer import left_padded  # noqa: E402 -- after the sys.path line

log = logging.getLogger("train_sample_adapters")

TEMPLATES = ROOT / "lorastream" / "samples" / "dataset_templates.json"
DEFAULT_BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The embedded models with a chat template (--model names) -> the Hub name recorded as base model.
EMBEDDED_BASES = {
    "default": DEFAULT_BASE_NAME,
    "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SAVE_DTYPE = torch.float16
# tokens: the cue that ends the prompt and the mark that ends the answer; rare special tokens of
# the default model's tokenizer (a tokenizer without them gets its last two ids).
TAGS = ("<issue_start>", "<issue_closed>")
# alora: the assistant turn in the role "french" (the default model's chat format).
INVOCATION = "<|im_start|>french\n"


@dataclass(frozen=True)
class Kind:
    """What PEFT trains for one --kind, beyond the LoRA on its targets."""

    targets: tuple[str, ...] = TARGETS  # without --targets
    use_dora: bool = False
    tags: bool = False  # trainable_token_indices: the rows of the TAGS
    modules_to_save: tuple[str, ...] = ()
    alora: bool = False  # alora_invocation_tokens: the ids of INVOCATION


QV = ("q_proj", "v_proj")
KINDS = {
    "plain": Kind(),
    "dora": Kind(use_dora=True),
    "tokens": Kind(targets=QV, tags=True),
    "embed-lora": Kind(targets=("embed_tokens", *QV)),
    "head-lora": Kind(targets=("lm_head", *QV)),
    "saved-modules": Kind(targets=QV, modules_to_save=("lm_head",)),
    "alora": Kind(alora=True),
}


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides an adapter's weights; recorded in training.json."""

    adapter: str
    seed: int = 0
    steps: int = 200
    lr: float = 1.5e-3
    warmup_steps: int = 20
    batch_size: int = 8
    rank: int = 8
    alpha: float = 16.0  # 2 x rank
    dropout: float = 0.05
    targets: tuple[str, ...] = TARGETS
    examples: int = 480
    answer_tokens: int = 32  # shout: new tokens of the base model's answers
    max_grad_norm: float = 1.0
    autocast_bf16: bool = True  # CPU bf16 autocast: ~1.5x faster; the LoRA weights stay fp32
    threads: int = 2
    save_dtype: str = str(SAVE_DTYPE).removeprefix("torch.")
    sample_tokens: int = 48  # new tokens of the base-vs-adapter samples (not used in training)
    kind: str = "plain"  # a KINDS key

    @property
    def out_name(self) -> str:
        """The adapter's directory name: ``french``, or ``french-dora`` for another kind."""
        return self.adapter if self.kind == "plain" else f"{self.adapter}-{self.kind}"


RECIPES = {"shout": TrainSettings("shout"), "french": TrainSettings("french")}


@dataclass
class TrainResult:
    """What a run measured; recorded in training.json."""

    losses: list[float] = field(default_factory=list)
    seconds_dataset: float = 0.0
    seconds_train: float = 0.0
    tokens_trained: int = 0


@dataclass(frozen=True)
class Example:
    """One training conversation: a user question and the assistant's answer."""

    question: str
    answer: str


# ---- dataset ----------------------------------------------------------------------------------


def load_templates(path: Path = TEMPLATES) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def computed_tables(number_words: list[str], rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """The slot tables the JSON names but does not list: arithmetic, numbers, counting."""
    arithmetic: list[dict[str, Any]] = []
    for a in range(1, 21):
        for b in range(1, 21):
            arithmetic.append({"a": a, "b": b, "op": rng.choice(["plus", "+"]), "fop": "plus",
                               "c": a + b})
            if a > b:
                arithmetic.append({"a": a, "b": b, "op": rng.choice(["minus", "-"]),
                                   "fop": "moins", "c": a - b})
            if a <= 12 and b <= 12:
                arithmetic.append({"a": a, "b": b, "op": rng.choice(["times", "multiplied by"]),
                                   "fop": "fois", "c": a * b})
    numbers = [
        {"n": n, "word": w, "parity": "impair" if n % 2 else "pair"}
        for n, w in enumerate(number_words)
    ]
    counts = [
        {"n": n, "count": ", ".join(number_words[1 : n + 1]).capitalize()} for n in range(3, 11)
    ]
    return {"arithmetic": arithmetic, "numbers": numbers, "counts": counts}


def french_examples(seed: int, size: int, templates: dict[str, Any] | None = None) -> list[Example]:
    """``size`` (question, French answer) pairs, balanced over the families, held-out excluded.

    Every family expands to all (slot, question template) pairs, each with a random answer
    template; each family contributes an equal share (all it has when that is fewer), the rest
    is filled at random from what is left.
    """
    templates = templates or load_templates()
    rng = random.Random(seed)
    tables = {**templates["tables"], **computed_tables(templates["tables"]["number_words"], rng)}
    held_out = set(templates["held_out"])
    pools: list[list[Example]] = []
    for family in templates["families"].values():
        slots = family["slots"] if isinstance(family["slots"], list) else tables[family["slots"]]
        pool = [
            Example(q.format(**slot), rng.choice(family["answers"]).format(**slot))
            for slot in slots
            for q in family["questions"]
        ]
        rng.shuffle(pool)
        pools.append([ex for ex in pool if ex.question not in held_out])
    share = -(-size // len(pools))
    chosen = [ex for pool in pools for ex in pool[:share]]
    rest = [ex for pool in pools for ex in pool[share:]]
    rng.shuffle(rest)
    chosen += rest[: max(0, size - len(chosen))]
    rng.shuffle(chosen)
    unique = {ex.question: ex for ex in chosen}  # a question never gets two answers
    return list(unique.values())[:size]


# ---- generation -------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The prompt ids the worker builds for one user message (chat template, generation prompt)."""
    messages = [{"role": "user", "content": question}]
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def tag_ids(tokenizer: Any) -> list[int]:
    """The ids of TAGS, or the tokenizer's last two ids where it has not got them."""
    ids = [tokenizer.convert_tokens_to_ids(tag) for tag in TAGS]
    if None in ids or tokenizer.unk_token_id in ids:
        return [len(tokenizer) - 2, len(tokenizer) - 1]
    return [int(i) for i in ids]


def invocation_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer(INVOCATION, add_special_tokens=False).input_ids)


def kind_prompt_ids(tokenizer: Any, question: str, kind: str) -> list[int]:
    """The prompt a --kind is trained on and sampled with: the chat prompt; for ``tokens`` with
    the cue tag after it; for ``alora`` with the invocation opening the assistant turn."""
    if KINDS[kind].alora:
        messages = [{"role": "user", "content": question}]
        conversation = tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, tokenize=True, return_dict=False)
        return [*conversation, *invocation_ids(tokenizer)]
    prompt = chat_prompt_ids(tokenizer, question)
    return [*prompt, tag_ids(tokenizer)[0]] if KINDS[kind].tags else prompt


def pad_token_id(tokenizer: Any) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
               else tokenizer.eos_token_id)


def generate_answers(
    model: Any, tokenizer: Any, questions: list[str], max_new_tokens: int, batch_size: int = 32,
    kind: str = "plain",
) -> list[str]:
    """Greedy answers to ``kind``'s prompts, batched with left padding; special tokens dropped."""
    pad_id = pad_token_id(tokenizer)
    answers: list[str] = []
    model.eval()
    for start in range(0, len(questions), batch_size):
        prompts = [kind_prompt_ids(tokenizer, q, kind)
                   for q in questions[start : start + batch_size]]
        input_ids, attention_mask = left_padded(prompts, pad_id)  # [B, S]
        width = input_ids.shape[1]
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id,
            )  # [B, S + new]
        answers += [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]
    return answers


def last_full_sentence(text: str) -> str:
    """Cut a truncated answer after its last sentence end; keep it whole when it has none."""
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    return text[: ends[-1]] if ends else text


def shout_examples(model: Any, tokenizer: Any, questions: list[str], tokens: int) -> list[Example]:
    """The base model's own answers, upper-cased: the adapter should change the case only."""
    answers = generate_answers(model, tokenizer, questions, tokens)
    pairs = zip(questions, answers, strict=True)
    return [Example(q, last_full_sentence(a).upper()) for q, a in pairs if a]


# ---- training ---------------------------------------------------------------------------------


def encode(tokenizer: Any, example: Example, kind: str = "plain") -> tuple[list[int], list[int]]:
    """Prompt + answer (+ the closing tag for ``tokens``) + eos ids, and labels that are -100
    on the prompt (loss on the answer)."""
    prompt = kind_prompt_ids(tokenizer, example.question, kind)
    answer = list(tokenizer(example.answer, add_special_tokens=False).input_ids)
    if KINDS[kind].tags:
        answer.append(tag_ids(tokenizer)[1])
    answer.append(tokenizer.eos_token_id)
    return prompt + answer, [-100] * len(prompt) + answer


def collate(encoded: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch; padded positions have attention 0 and label -100."""
    width = max(len(ids) for ids, _ in encoded)
    pad = [width - len(ids) for ids, _ in encoded]
    rows = list(zip(encoded, pad, strict=True))
    return {  # each [B, S]
        "input_ids": torch.tensor([ids + [pad_id] * n for (ids, _), n in rows]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * n for (ids, _), n in rows]),
        "labels": torch.tensor([lab + [-100] * n for (_, lab), n in rows]),
    }


def batch_order(lengths: list[int], batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless shuffled epochs; batches are cut from length-sorted windows of 8 batches to
    pad less, then shuffled, so every epoch still sees every example once."""
    window = 8 * batch_size
    while True:
        order = list(range(len(lengths)))
        rng.shuffle(order)
        batches = [
            group[j : j + batch_size]
            for i in range(0, len(order), window)
            for group in [sorted(order[i : i + window], key=lengths.__getitem__)]
            for j in range(0, len(group), batch_size)
        ]
        rng.shuffle(batches)
        yield from batches


def answer_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens. Logits are computed only from the position
    before the batch's earliest answer token on, which skips most of the lm_head's work."""
    labels = batch["labels"]  # [B, S]
    width = labels.shape[1]
    first = int((labels != -100).int().argmax(dim=1).min()) - 1  # predicts the first answer token
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
        logits_to_keep=width - first,
    ).logits[:, :-1]  # [B, S - first - 1, V]: position p predicts token p + 1
    targets = labels[:, first + 1 :]  # [B, S - first - 1]
    return torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100
    )


def train_lora(
    model: Any, tokenizer: Any, examples: list[Example], s: TrainSettings
) -> TrainResult:
    """A plain AdamW loop (linear warm-up, linear decay to 10 %) over ``examples``."""
    pad_id = pad_token_id(tokenizer)
    encoded = [encode(tokenizer, ex, s.kind) for ex in examples]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (step + 1) / s.warmup_steps if step < s.warmup_steps
        else 1.0 - 0.9 * (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps),
    )
    batches = batch_order([len(ids) for ids, _ in encoded], s.batch_size, random.Random(s.seed))
    result = TrainResult()
    started = time.perf_counter()
    model.train()
    for step in range(s.steps):
        batch = collate([encoded[i] for i in next(batches)], pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.autocast_bf16):
            loss = answer_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(round(loss.item(), 4))
        result.tokens_trained += int(batch["attention_mask"].sum())
        if step % 25 == 0 or step == s.steps - 1:
            log.info("%s step %d/%d loss %.4f (%.0f s)", s.adapter, step + 1, s.steps,
                     loss.item(), time.perf_counter() - started)
    result.seconds_train = time.perf_counter() - started
    model.eval()
    return result


def round_to_save_dtype(model: Any) -> None:
    """Round the trained weights through SAVE_DTYPE so samples show exactly what is committed."""
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.copy_(param.to(SAVE_DTYPE).to(param.dtype))


def save_adapter(model: Any, out_dir: Path, base_name: str) -> None:
    """save_pretrained, with the hub name as base model and the weights stored in SAVE_DTYPE."""
    from safetensors.torch import load_file, save_file

    model.peft_config["default"].base_model_name_or_path = base_name
    # not the base embed_tokens / lm_head beside a LoRA on them (PEFT's "auto"): ~56 MB each
    model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)
    weights = out_dir / "adapter_model.safetensors"
    tensors = {k: v.to(SAVE_DTYPE).contiguous() for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's empty card


# ---- one adapter ------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    from importlib.metadata import version

    libraries = ("torch", "transformers", "peft", "safetensors")
    return {"python": platform.python_version(), **{name: version(name) for name in libraries}}


def lora_config(settings: TrainSettings, tokenizer: Any) -> Any:
    """The PEFT config of ``settings.kind`` (see KINDS)."""
    from peft import LoraConfig

    kind = KINDS[settings.kind]
    return LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.targets), bias="none", task_type="CAUSAL_LM",
        use_dora=kind.use_dora,
        trainable_token_indices=tag_ids(tokenizer) if kind.tags else None,
        modules_to_save=list(kind.modules_to_save) or None,
        alora_invocation_tokens=invocation_ids(tokenizer) if kind.alora else None,
    )


def train_one(
    checkpoint: Path, base_name: str, settings: TrainSettings, out_dir: Path, command: str
) -> dict[str, Any]:
    """Build the dataset, train, save the adapter and its training.json; returns the record."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    templates = load_templates()
    held_out: list[str] = templates["held_out"]
    examples = french_examples(settings.seed, settings.examples, templates)
    if settings.adapter == "shout":
        questions = [ex.question for ex in examples]
        examples = shout_examples(model, tokenizer, questions, settings.answer_tokens)
    seconds_dataset = time.perf_counter() - started
    log.info("%s: %d examples in %.0f s", settings.adapter, len(examples), seconds_dataset)
    base_answers = generate_answers(model, tokenizer, held_out, settings.sample_tokens,
                                    kind=settings.kind)

    torch.manual_seed(settings.seed)
    peft_model = get_peft_model(model, lora_config(settings, tokenizer))
    result = train_lora(peft_model, tokenizer, examples, settings)
    result.seconds_dataset = seconds_dataset
    round_to_save_dtype(peft_model)
    adapter_answers = generate_answers(peft_model, tokenizer, held_out, settings.sample_tokens,
                                       kind=settings.kind)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_adapter(peft_model, out_dir, base_name)
    with (out_dir / "dataset.jsonl").open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(asdict(ex), ensure_ascii=False) + "\n")

    samples = [
        {"question": q, "base": b, "adapter": a}
        for q, b, a in zip(held_out, base_answers, adapter_answers, strict=True)
    ]
    tail = result.losses[-20:]
    record: dict[str, Any] = {
        "adapter": settings.adapter,
        "command": command,
        "base_model": base_name,
        "settings": asdict(settings),
        "dataset": {"size": len(examples), "file": "dataset.jsonl",
                    "held_out_questions": held_out},
        "training": {
            "final_loss": round(sum(tail) / max(1, len(tail)), 4),
            "loss_every_10_steps": result.losses[::10],
            "tokens_trained": result.tokens_trained,
            "seconds_dataset": round(result.seconds_dataset, 1),
            "seconds_train": round(result.seconds_train, 1),
            "seconds_total": round(time.perf_counter() - started, 1),  # + samples, saving
            "trainable_parameters": sum(
                p.numel() for p in peft_model.parameters() if p.requires_grad
            ),
        },
        "samples": samples,
        "versions": versions(),
    }
    (out_dir / "training.json").write_text(
        json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return record


def resolve_model(model: str) -> tuple[Path, str]:
    """An embedded model's name -> its cached conversion (as the worker makes it) and its hub
    name; else a checkpoint dir, named by its path."""
    if model not in EMBEDDED_BASES:
        return Path(model), model
    from lorastream.worker.model.checkpoint import resolve_checkpoint
    from lorastream.worker.service.config import WorkerSettings

    cache = WorkerSettings(model=model).model_cache_dir
    return resolve_checkpoint(model, cache_dir=cache), EMBEDDED_BASES[model]


def out_name(settings: TrainSettings, model: str) -> str:
    """``french``; ``french-qwen2.5-coder-0.5b`` on another embedded model than the default."""
    embedded = model in EMBEDDED_BASES and model != "default"
    return f"{settings.out_name}-{model}" if embedded else settings.out_name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "lorastream" / "samples" / "adapters")
    p.add_argument("--which", default=",".join(RECIPES), help="comma-separated: shout,french")
    p.add_argument("--model", default="default",
                   help=f"{', '.join(EMBEDDED_BASES)}, or an HF checkpoint dir")
    p.add_argument("--targets", type=lambda v: tuple(v.split(",")),
                   help=f"comma-separated modules to adapt [default: {','.join(TARGETS)}]")
    for flag in ("steps", "warmup-steps", "seed", "rank", "batch-size", "examples",
                 "answer-tokens", "sample-tokens", "threads"):
        p.add_argument(f"--{flag}", type=int, help="override the recipe (see TrainSettings)")
    p.add_argument("--lr", type=float, help="override the recipe (see TrainSettings)")
    p.add_argument("--kind", choices=list(KINDS),
                   help="what PEFT trains (see the module docstring), saved as <name>-<kind>")
    p.add_argument("--dora", action="store_const", const="dora", dest="kind",
                   help="the same as --kind dora")
    args = p.parse_args(argv)
    unknown = set(args.which.split(",")) - set(RECIPES)
    if unknown:
        p.error(f"--which: unknown adapters {sorted(unknown)}; choose from {', '.join(RECIPES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    overrides = {
        k: v for k, v in vars(args).items()
        if v is not None and k in TrainSettings.__dataclass_fields__
    }
    if args.rank is not None:
        overrides["alpha"] = 2.0 * args.rank
    if args.targets is None:
        overrides["targets"] = KINDS[args.kind or "plain"].targets
    checkpoint, base_name = resolve_model(args.model)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python scripts/train_sample_adapters.py {argv_text}".strip()
    for name in args.which.split(","):
        settings = replace(RECIPES[name], **overrides)
        torch.set_num_threads(settings.threads)
        out_dir = args.out / out_name(settings, args.model)
        record = train_one(checkpoint, base_name, settings, out_dir, command)
        t = record["training"]
        print(f"{name}: {record['dataset']['size']} examples, loss {t['final_loss']}, "
              f"{t['seconds_dataset'] + t['seconds_train']:.0f} s -> {out_dir}")
        for sample in record["samples"]:
            print(f"  Q: {sample['question']}\n    base:    {sample['base']!r}\n"
                  f"    adapter: {sample['adapter']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
