"""Issue 23 item 3 at the gateway: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
(operate token) and /tokenize, /detokenize (API key), on a real store, worker and gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from lorastream.core.store_client import StoreClient
from tests.gateway.conftest import BASE, CONTEXT, TOKEN, Cluster, ClusterFactory
from tests.support.models import make_vocab_adapter, save_adapter_tokenizer

KEY = "inference-key-vllm"
MAX_RANK = 16  # the worker refuses rank 64: a load it must un-stage


@pytest.fixture(scope="module")
def keyed(cluster_factory: ClusterFactory) -> Cluster:
    """One worker (largest rank 16); a gateway with the operate token and one API key."""
    return cluster_factory(workers=1, worker_overrides={"max_lora_rank": MAX_RANK},
                           api_keys=[KEY])


def _client(cluster: Cluster) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"{cluster.gateway.url}/v1", api_key=KEY, max_retries=0,
                           timeout=30)
    cluster.gateway.clients.append(client)  # closed with the gateway
    return client


def _post(cluster: Cluster, path: str, body: object, token: str | None = TOKEN) -> tuple[int, Any]:
    """(status, JSON body or text) of a POST, with the operate token unless told."""
    with cluster.gateway.http(token) as http:
        response = http.post(path, json=body)
    is_json = response.headers["content-type"].startswith("application/json")
    return response.status_code, response.json() if is_json else response.text


def _chat(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    return reply.choices[0].message.content or ""


def test_load_lists_and_serves_the_adapter_and_unload_makes_it_404(
    keyed: Cluster, tiny_adapters: dict[str, Path]
) -> None:
    client = _client(keyed)
    body = {"lora_name": "vllm-mlp", "lora_path": str(tiny_adapters["mlp-r8"])}
    assert _post(keyed, "/v1/load_lora_adapter", body) == (
        200, "Success: LoRA adapter 'vllm-mlp' added successfully.")
    assert "vllm-mlp" in {m.id for m in client.models.list()}
    (worker,) = keyed.workers
    assert "vllm-mlp" in {a.name for a in worker.engine.adapters.statuses()}  # loaded, checked
    # the same weights under their stored name answer the same
    assert _chat(client, "vllm-mlp") == _chat(client, "mlp-r8") != _chat(client, BASE)

    status, again = _post(keyed, "/v1/load_lora_adapter", body)
    assert status == 400 and again["error"]["param"] == "lora_name"
    assert "has already been loaded" in again["error"]["message"]

    assert _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "vllm-mlp"}) == (
        200, "Success: LoRA adapter 'vllm-mlp' removed successfully.")
    assert "vllm-mlp" not in {m.id for m in client.models.list()}
    with pytest.raises(openai.NotFoundError):
        _chat(client, "vllm-mlp")
    status, gone = _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "vllm-mlp"})
    assert status == 404 and gone["error"]["param"] == "lora_name"
    assert gone["error"]["message"] == "The lora adapter 'vllm-mlp' cannot be found."


def test_unloading_one_of_two_names_for_the_same_weights_keeps_the_other_served(
    keyed: Cluster, tiny_adapters: dict[str, Path]
) -> None:
    """The worker keeps one copy per content id; unloading the name that copy was fetched under
    must not leave the other name refetching under the forgotten one (it got 404)."""
    client = _client(keyed)
    body = {"lora_name": "vllm-twin", "lora_path": str(tiny_adapters["attn-r4"])}
    assert _post(keyed, "/v1/load_lora_adapter", body)[0] == 200
    before = _chat(client, "attn-r4")
    assert _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "vllm-twin"})[0] == 200
    assert _chat(client, "attn-r4") == before


def test_load_inplace_replaces_the_weights_of_a_loaded_name(
    keyed: Cluster, tiny_adapters: dict[str, Path]
) -> None:
    client = _client(keyed)
    first = {"lora_name": "vllm-swap", "lora_path": str(tiny_adapters["attn-r4"])}
    assert _post(keyed, "/v1/load_lora_adapter", first)[0] == 200
    assert _chat(client, "vllm-swap") == _chat(client, "attn-r4")
    swap = {"lora_name": "vllm-swap", "lora_path": str(tiny_adapters["mlp-r8"]),
            "load_inplace": True}
    status, text = _post(keyed, "/v1/load_lora_adapter", swap)
    assert status == 200, text
    assert _chat(client, "vllm-swap") == _chat(client, "mlp-r8")
    assert _post(keyed, "/v1/unload_lora_adapter", {"lora_name": "vllm-swap"})[0] == 200


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"lora_name": "x", "lora_path": "MISSING"}, 404, "lora_path"),  # under the allowed root
    ({"lora_name": "x", "lora_path": "/etc"}, 400, "lora_path"),  # outside the allowed root
    ({"lora_name": "x", "lora_path": "EMPTY"}, 400, "lora_path"),  # a directory, no adapter
    ({"lora_name": "x", "lora_path": "all-r64"}, 400, "lora_path"),  # the worker refuses rank 64
    ({"lora_name": BASE, "lora_path": "mlp-r8"}, 400, "lora_name"),
    ({"lora_name": "x"}, 400, "lora_path"),
    ({"lora_name": "x", "lora_path": "mlp-r8", "base_model_name": "y"}, 400, "base_model_name"),
], ids=["missing-path", "outside-root", "not-an-adapter", "worker-refuses", "base-model-name",
        "no-path", "unknown-field"])
def test_a_refused_load_names_its_param_and_stages_nothing(
    keyed: Cluster, tiny_adapters: dict[str, Path], tmp_path: Path, body: dict[str, str],
    status: int, param: str,
) -> None:
    if "lora_path" in body:
        path = body["lora_path"]
        local = {"EMPTY": tmp_path, "MISSING": tmp_path / "missing", **tiny_adapters}
        body = {**body, "lora_path": str(local.get(path, path))}
    got, error = _post(keyed, "/v1/load_lora_adapter", body)
    assert got == status, error
    assert error["error"]["param"] == param
    assert "x" not in {m.id for m in _client(keyed).models.list()}


@pytest.mark.parametrize(("body", "param"), [
    ({}, "lora_name"), ({"lora_name": "attn-r4", "lora_int_id": 3}, "lora_int_id"),
], ids=["no-name", "int-id"])
def test_a_refused_unload_names_its_param(keyed: Cluster, body: object, param: str) -> None:
    status, error = _post(keyed, "/v1/unload_lora_adapter", body)
    assert status == 400 and error["error"]["param"] == param


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
@pytest.mark.parametrize(("token", "status"), [(None, 401), ("wrong", 401), (KEY, 403)],
                         ids=["anonymous", "wrong", "api-key"])
def test_load_and_unload_need_the_operate_token(
    keyed: Cluster, tiny_adapters: dict[str, Path], path: str, token: str | None, status: int
) -> None:
    body = {"lora_name": "attn-r4", "lora_path": str(tiny_adapters["attn-r4"])}
    if path.endswith("unload_lora_adapter"):
        body = {"lora_name": "attn-r4"}
    got, error = _post(keyed, path, body, token)
    assert got == status
    assert error["error"]["type"] == (
        "permission_error" if status == 403 else "authentication_error")
    assert "attn-r4" in {m.id for m in _client(keyed).models.list()}


@pytest.mark.parametrize("model", [None, BASE, "attn-r4"], ids=["default", "base", "adapter"])
def test_tokenize_counts_what_a_completion_prefills(keyed: Cluster, model: str | None) -> None:
    client = _client(keyed)
    body = {"prompt": "Hello there"} | ({"model": model} if model else {})
    status, tokenized = _post(keyed, "/tokenize", body, KEY)
    assert status == 200, tokenized
    assert tokenized == {"count": len(tokenized["tokens"]), "max_model_len": CONTEXT,
                         "tokens": tokenized["tokens"], "token_strs": None}
    usage = client.completions.create(model=BASE, prompt="Hello there", max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == tokenized["count"]
    assert _post(keyed, "/detokenize", {"model": BASE, "tokens": tokenized["tokens"]},
                 KEY) == (200, {"prompt": "Hello there"})


def test_tokenize_chat_counts_what_a_chat_completion_prefills(keyed: Cluster) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, tokenized = _post(keyed, "/tokenize", {"model": BASE, "messages": messages,
                                                   "return_token_strs": True}, KEY)
    assert status == 200, tokenized
    reply = _client(keyed).chat.completions.create(
        model=BASE, messages=messages, max_tokens=1  # type: ignore[arg-type]  # plain dicts, not openai's TypedDicts
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == tokenized["count"]
    assert "".join(tokenized["token_strs"]) == "<system>Be brief.<user>Hi<assistant>"
    status, bare = _post(keyed, "/tokenize", {"messages": messages,
                                              "add_generation_prompt": False}, KEY)
    assert bare["count"] == tokenized["count"] - len("<assistant>")


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": "no-such-adapter", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"model": "no-such-adapter", "tokens": [5]}, 404, "model"),
    ("/tokenize", {"model": BASE}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/detokenize", {"tokens": [1 << 20]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
], ids=["unknown-model", "detok-unknown-model", "no-input", "continue-final", "chat-template",
        "past-vocab", "negative"])
def test_tokenizer_errors_are_openai_shaped(
    keyed: Cluster, path: str, body: object, status: int, param: str
) -> None:
    got, error = _post(keyed, path, body, KEY)
    assert got == status, error
    assert error["error"]["param"] == param
    if status == 404:
        assert error["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("token", "status"), [(None, 401), ("wrong", 401), (KEY, 200),
                                               (TOKEN, 200)])
def test_tokenize_needs_an_api_key(keyed: Cluster, token: str | None, status: int) -> None:
    assert _post(keyed, "/tokenize", {"prompt": "x"}, token)[0] == status
    assert _post(keyed, "/detokenize", {"tokens": [40]}, token)[0] == status


@pytest.fixture(scope="module")
def tool_adapter(keyed: Cluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> str:
    """A TrainableTokens adapter (PEFT) staged with its tokenizer, which names reserved id 200
    ``<tool>``."""
    path = make_vocab_adapter(tiny_model, tmp_path_factory.mktemp("tool"), rank=4, seed=3,
                              target_modules=["q_proj"], trainable_token_indices=[200])
    save_adapter_tokenizer(tiny_model, path, {200: "<tool>"})
    with StoreClient(keyed.store) as store:
        for _ in store.preload(str(path), "tool"):
            pass
    return "tool"


@pytest.mark.parametrize("prefix", ["", "/v1"], ids=["vllm", "v1"])
@pytest.mark.parametrize(("model", "tokens"), [
    (BASE, [68, 69, 31, 87, 82, 82, 79, 33, 70]),  # "<tool>" as six characters
    ("tool", [68, 69, 200, 70]),  # its added token
], ids=["base", "adapter"])
def test_tokenize_and_detokenize_use_the_models_own_tokenizer(
    keyed: Cluster, tool_adapter: str, prefix: str, model: str, tokens: list[int]
) -> None:
    status, tokenized = _post(keyed, f"{prefix}/tokenize",
                              {"model": model, "prompt": "ab<tool>c", "return_token_strs": True},
                              KEY)
    assert status == 200, tokenized
    assert tokenized["tokens"] == tokens
    assert ("<tool>" in tokenized["token_strs"]) is (model == tool_adapter)
    text = "ab<tool>c" if model == tool_adapter else "ab<x200>c"
    assert _post(keyed, f"{prefix}/detokenize", {"model": model, "tokens": [68, 69, 200, 70]},
                 KEY) == (200, {"prompt": text})
