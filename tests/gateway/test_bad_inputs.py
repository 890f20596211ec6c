"""Raw HTTP with bad inputs: every error is OpenAI's error body with the right status, quickly."""

from __future__ import annotations

import json

import pytest

from tests.gateway.conftest import BASE, Cluster


def _error(response: object) -> dict[str, object]:
    body = response.json()  # type: ignore[attr-defined]  # typed object: an httpx.Response
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "text"),
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", b"", 400, None, ""),
        ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": "hi"', 400, None, "JSON"),
        ("/v1/completions", b'{"prompt": "x"}', 400, "model", "required"),
        ("/v1/completions", b'{"model": "tiny"}', 400, "prompt", "required"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages", ""),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -5}', 400,
         "max_tokens", "greater than or equal to 1"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "5"}', 400,
         "max_tokens", ""),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": true}', 400,
         "max_tokens", ""),
        ("/v1/completions", b'{"model": "tiny", "prompt": ["a", "b"]}', 400, "prompt",
         "one prompt per request"),
        ("/v1/completions", b'{"model": "tiny", "prompt": ""}', 400, "prompt", "empty"),
        ("/v1/completions", b'{"model": "tiny", "prompt": [999999999999]}', 400, "prompt", ""),
        ("/v1/completions", b'{"model": "tiny", "prompt": [300]}', 400, "prompt", "vocabulary"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": -1}', 400, "seed", ""),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": [""]}', 400, "stop",
         "empty"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "echo": true}', 400, "echo",
         "echo"),
        ("/v1/chat/completions",
         b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}', 400, "messages",
         ""),
        ("/v1/completions", b'{"model": "ghost", "prompt": "x"}', 404, "model", "ghost"),
        ("/v1/nothing-here", b"{}", 404, None, ""),
    ],
)
def test_malformed_and_invalid_requests_get_openai_errors(
    cluster: Cluster, path: str, body: bytes, status: int, param: str | None, text: str
) -> None:
    with cluster.gateway.http() as http:
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = _error(response)
    assert error["param"] == param, error
    assert text in str(error["message"]), error


def test_a_prompt_longer_than_the_context_is_400_on_both_endpoints(cluster: Cluster) -> None:
    huge = "y" * 5000
    with cluster.gateway.http() as http:
        plain = http.post("/v1/completions", json={"model": BASE, "prompt": huge})
        chat = http.post("/v1/chat/completions", json={
            "model": "attn-r4", "messages": [{"role": "user", "content": huge}], "stream": True})
    for response, param in ((plain, "prompt"), (chat, "messages")):
        assert response.status_code == 400
        error = _error(response)
        assert error["param"] == param and "context" in str(error["message"])


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_413(cluster: Cluster, chunked: bool) -> None:
    limit = cluster.gateway.settings.max_body_bytes
    body = json.dumps({"model": BASE, "prompt": "z" * (limit + 10)}).encode()
    # A generator body is sent chunked, without Content-Length: the limit counts the bytes.
    content = (body[i:i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    with cluster.gateway.http() as http:
        response = http.post("/v1/completions", content=content,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert _error(response)["code"] == "request_too_large"


def test_json_without_a_content_type_header_is_accepted(cluster: Cluster) -> None:
    with cluster.gateway.http() as http:
        response = http.post("/v1/completions",
                             content=b'{"model": "tiny", "prompt": "x", "max_tokens": 2}')
        assert "content-type" not in response.request.headers
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 2


def test_the_gateway_keeps_serving_after_bad_requests(cluster: Cluster) -> None:
    with cluster.gateway.http() as http:
        for _ in range(3):
            http.post("/v1/completions", content=b"{")
        response = http.post("/v1/completions", json={"model": "attn-r4", "prompt": "ok",
                                                       "max_tokens": 3})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == response.json()["id"]
