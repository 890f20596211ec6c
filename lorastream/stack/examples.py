"""What `lorastream up` prints once the stack serves: commands that run as printed in a new
shell (greedy, absolute paths, the stack's TLS files and token where it has them)."""

from __future__ import annotations

import importlib.util
import shlex
import sys

from lorastream.stack.launcher import (
    SAMPLE_ADAPTERS,
    SAMPLE_QUESTION,
    SAMPLES_DIR,
    Stack,
    cli_command,
    sample_adapters,
)


def generated_token(stack: Stack) -> bool:
    """True when the stack made its operate token (and wrote it to ``stack.token_file``)."""
    return bool(stack.tokens.operate) and not stack.config.token


def operator_lines(stack: Stack) -> list[str]:
    """The operator part of what `lorastream up` prints: the operate token, shown once here."""
    intro = ("Operators: register an adapter (any PEFT LoRA directory under the samples, an "
             "--adapter or an --allowed-local-root directory, s3:// or hf:// URI; here a copy of "
             "a sample) and list them.")
    if not stack.tokens.operate:
        return [intro + " The stack has no token (--insecure-no-auth): anyone on this machine "
                "may do the same:"]
    if generated_token(stack):
        told = (f"Operator token (shown once; also in {stack.token_file}, mode 0600): "
                f"{stack.tokens.operate}")
    else:
        told = ("Operator token: the one you gave (--token or LORASTREAM_TOKEN); the commands "
                "below read it from LORASTREAM_TOKEN.")
    return [told, intro + " These calls need the token:"]


def examples(stack: Stack, model: str) -> str:
    """What `lorastream up` prints: commands that run as printed in a new shell, all greedy
    (temperature 0), so the base model and each sample adapter answer the same question in their
    own, repeatable way."""
    worker = stack.workers[0]
    adapter = next(iter(stack.config.adapters), model)
    shipped = sample_adapters()
    samples = [name for name, uri in stack.config.adapters.items() if shipped.get(name) == uri]
    question = SAMPLE_QUESTION if samples else "Hello!"
    api = f"{stack.gateway}/v1"
    cli = cli_command()
    certs = stack.certs
    curl = "curl" if certs is None else f"curl --cacert {shlex.quote(str(certs.ca))}"
    lines = [
        f"lorastream is up: gateway {stack.gateway}, store {stack.store}, "
        f"workers {', '.join(stack.workers)}.",
    ]
    if samples:
        lines.append("Sample adapters registered: " + "; ".join(
            f"{name} ({SAMPLE_ADAPTERS[name]})" for name in samples
        ) + f". Ask the same question with model = {', '.join(samples)} or {model}:")
    lines += [
        "Try the OpenAI API (model = an adapter name, or the base model; temperature 0 is "
        "greedy):",
        f"  {curl} {api}/models",
    ]
    for name in [*samples, model] if samples else [adapter]:
        lines.append(
            f"  {curl} {api}/chat/completions -H 'Content-Type: application/json' -d "
            f"'{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
            f"\"content\": \"{question}\"}}], \"max_tokens\": 32, \"temperature\": 0}}'"
        )
    lines += [
        f"  {curl} -N {api}/completions -H 'Content-Type: application/json' -d "
        f"'{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", "
        f"\"max_tokens\": 16, \"temperature\": 0, \"stream\": true}}'",
    ]
    https_client = "" if certs is None else (
        f", http_client=httpx.Client(verify=ssl.create_default_context(cafile=\"{certs.ca}\"))"
    )
    client_lines = [
        f"{shlex.quote(sys.executable)} - <<'EOF'",
        *([] if certs is None else ["import ssl, httpx"]),
        "from openai import OpenAI",
        f"client = OpenAI(base_url=\"{api}\", api_key=\"unused\"{https_client})",
        f"reply = client.chat.completions.create(model=\"{adapter}\", max_tokens=32, "
        "temperature=0,",
        f"    messages=[{{\"role\": \"user\", \"content\": \"{question}\"}}])",
        "print(reply.choices[0].message.content)",
        "EOF",
    ]
    if importlib.util.find_spec("openai") is None:
        lines += ["The official openai client (not a lorastream dependency: install it once, "
                  "then paste the rest into a shell):",
                  f"  {shlex.quote(sys.executable)} -m pip install openai", *client_lines]
    else:
        lines += ["The official openai client (paste into a shell):", *client_lines]
    # the store and the workers ask the CLI for the stack's client certificate (mutual TLS)
    tls_flags = "" if certs is None else (
        f" --tls-ca {shlex.quote(str(certs.ca))}"
        f" --tls-client-cert {shlex.quote(str(certs.client_cert))}"
        f" --tls-client-key {shlex.quote(str(certs.client_key))}"
    )
    lines += [
        "Or a worker directly (greedy unless --temperature):",
        f"  {cli} complete --worker {worker} --model {model} --chat --prompt '{question}'"
        f"{tls_flags}",
    ]
    for name in stack.config.adapters:
        lines.append(
            f"  {cli} complete --worker {worker} --model {name} --chat --prompt '{question}'"
            f"{tls_flags}"
        )
    sample_dir = SAMPLES_DIR / "french"
    auth, token_flags = "", ""  # a token of your own: the CLI reads LORASTREAM_TOKEN
    if generated_token(stack):
        source = shlex.quote(str(stack.token_file))
        auth = f" -H \"Authorization: Bearer $(cat {source})\""
        token_flags = f" --token-file {source}"
    elif stack.tokens.operate:
        auth = ' -H "Authorization: Bearer $LORASTREAM_TOKEN"'
    lines += [
        *operator_lines(stack),
        f"  {curl} {api}/adapters -H 'Content-Type: application/json'{auth} "
        f"-d '{{\"name\": \"my-adapter\", \"source\": \"{sample_dir}\"}}'",
        f"  {curl} {api}/adapters{auth}",
        f"  {cli} adapters preload {shlex.quote(str(sample_dir))} --name my-adapter "
        f"--store {stack.store}{tls_flags}{token_flags}",
        f"  {cli} adapters ls --store {stack.store}{tls_flags}{token_flags}",
        "Prometheus metrics (docs/metrics.md): " + ", ".join(
            f"{part} {url}" for part, url in stack.metrics_urls.items()
        ) + ". Where each worker found the adapters requests asked for:",
        f"  curl -s {stack.metrics_urls['worker 0']} | grep '^lorastream_worker_adapter_hits'",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)
