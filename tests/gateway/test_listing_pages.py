"""``GET /v1/models`` and ``GET /v1/adapters`` never build one body of every adapter: the full list
is streamed a store page at a time, and ``limit`` / ``after`` walk it in OpenAI's cursor pages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from lorastream.core.manifest import AdapterManifest
from lorastream.gateway.listing import Page, cursor_page, stream_list
from tests.gateway.conftest import STORED_ADAPTERS, TOKEN, Cluster


def test_the_full_model_list_is_streamed_in_name_order(cluster: Cluster) -> None:
    with cluster.gateway.http() as http:
        response = http.get("/v1/models")
    assert response.status_code == 200
    assert "content-length" not in response.headers  # written as it is read, not built first
    body = response.json()
    ids = [m["id"] for m in body["data"]]
    assert ids[0] == cluster.gateway.state.pool.base_model
    assert ids[1:] == sorted(STORED_ADAPTERS)


@pytest.mark.parametrize("limit", [1, 2, 3, 1000])
def test_cursor_pages_walk_the_same_list(cluster: Cluster, limit: int) -> None:
    with cluster.gateway.http() as http:
        full = [m["id"] for m in http.get("/v1/models").json()["data"]]
        walked, after, pages = [], None, 0
        while True:
            params: dict[str, object] = {"limit": limit}
            if after is not None:
                params["after"] = after
            page = http.get("/v1/models", params=params).json()
            pages += 1
            assert len(page["data"]) <= limit
            walked += [m["id"] for m in page["data"]]
            if not page["has_more"]:
                break
            assert page["last_id"] == page["data"][-1]["id"]
            after = page["last_id"]
    assert walked == full
    assert pages == max(1, -(-len(full) // limit))


@pytest.mark.parametrize("limit", [0, 1001, -1])
def test_a_limit_out_of_range_is_a_400(cluster: Cluster, limit: int) -> None:
    with cluster.gateway.http() as http:
        response = http.get("/v1/models", params={"limit": limit})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "limit"


def test_the_operator_list_is_streamed_with_the_cache_usage_at_its_end(cluster: Cluster) -> None:
    with cluster.gateway.http(TOKEN) as http:
        response = http.get("/v1/adapters")
    assert "content-length" not in response.headers
    body = response.json()
    assert [a["name"] for a in body["data"]] == sorted(STORED_ADAPTERS)
    assert 0 < body["cache_bytes_used"] < body["cache_bytes_budget"]


def _manifest(name: str) -> AdapterManifest:
    return AdapterManifest(adapter_id=f"id-{name}", name=name, source_uri="/x", revision="",
                           base_model="", rank=4, alpha=8.0, use_rslora=False,
                           target_modules=("q_proj",), tensors=())


async def _pages(names: list[list[str]], fetched: list[int]) -> AsyncIterator[Page]:
    for i, page in enumerate(names):
        fetched.append(i)
        yield [_manifest(n) for n in page], 10 * (i + 1), 100


def _items(page: list[AdapterManifest]) -> list[dict[str, object]]:
    return [{"id": m.name} for m in page]


def test_a_streamed_list_holds_one_page_at_a_time() -> None:
    """Page k+1 is fetched only after page k's items were written."""

    async def run() -> tuple[list[bytes], list[int], list[int]]:
        fetched: list[int] = []
        pages = _pages([["a", "b"], ["c"], ["d"]], fetched)
        response = await stream_list([{"id": "base"}], pages, _items,
                                     lambda page: {"used": page[1]})
        assert fetched == [0]  # the first page, before the response starts
        chunks, seen = [], []
        async for chunk in response.body_iterator:
            chunks.append(chunk if isinstance(chunk, bytes) else chunk.encode())
            seen.append(len(fetched))
        return chunks, fetched, seen

    chunks, fetched, seen = asyncio.run(run())
    body = json.loads(b"".join(chunks))
    assert [m["id"] for m in body["data"]] == ["base", "a", "b", "c", "d"]
    assert body["used"] == 30  # the last page's cache figures
    assert fetched == [0, 1, 2]
    assert seen[:4] == [1, 1, 1, 1]  # the head and page 0's items went out before page 1 came


def test_a_cursor_page_stops_reading_once_it_has_one_more_than_its_limit() -> None:
    fetched: list[int] = []
    pages = _pages([["a", "b"], ["c", "d"], ["e"]], fetched)
    page = asyncio.run(cursor_page([], pages, _items, 2))
    assert page["data"] == [{"id": "a"}, {"id": "b"}] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == ("a", "b")
    assert fetched == [0, 1]
