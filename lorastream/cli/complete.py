"""``lorastream complete``: a generation client for a worker."""

from __future__ import annotations

import json

import typer

from lorastream.cli.common import (
    Connection,
    console,
    out,
    reported_errors,
    worker_connection_options,
)


@worker_connection_options
def complete(
    model: str = typer.Option(
        ..., "--model", help="An adapter name, or the base model's served name."
    ),
    prompt: str = typer.Option(..., "--prompt", help="The prompt text (sent as is, no template)."),
    chat: bool = typer.Option(False, "--chat", help="Send the prompt as a user chat message."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 disables)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k likeliest tokens (0 disables)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    stream: bool = typer.Option(False, "--stream", help="Print tokens as they arrive."),
    as_json: bool = typer.Option(
        False, "--json", help='Print one line {"text": ..., "token_ids": [...]} (generated only).'
    ),
    *,
    conn: Connection,
) -> None:
    """Generate a completion from a worker. Greedy (temperature 0) stops at end-of-sequence."""
    from lorastream.core.generation import FinishReason, PromptInput, SamplingParams
    from lorastream.core.worker_client import WorkerClient

    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
        stop=tuple(stop),
    )
    prompt_input = PromptInput(messages=(("user", prompt),)) if chat else PromptInput(text=prompt)
    text: list[str] = []
    token_ids: list[int] = []
    reason: FinishReason | None = None
    with reported_errors(), WorkerClient(conn.target, tls=conn.tls()) as client:
        for event in client.generate(model, prompt_input, params):
            text.append(event.text)
            token_ids.extend(event.token_ids)
            reason = event.finish_reason
            if stream and not as_json:
                out.print(event.text, end="", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        typer.echo(json.dumps({"text": "".join(text), "token_ids": token_ids}))
    elif stream:
        out.print()
    else:
        out.print("".join(text), markup=False, highlight=False, soft_wrap=True)
    if reason is not None and not as_json:
        console.print(f"finish: {reason.value}, {len(token_ids)} tokens", style="dim", markup=False)
