"""HubSource against a real HTTP server speaking the Hub protocol, with the real huggingface_hub."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.adapter_validation import content_id
from lorastream.core.errors import (
    AdapterNotFound,
    InvalidAdapter,
    InvalidArgument,
    SourceUnavailable,
    Unauthenticated,
)
from lorastream.store.sources import SourceRegistry
from lorastream.store.sources.hub import SCRATCH_CACHE, HubSource, parse_hf_uri
from lorastream.store.store import AdapterStore
from tests.support.hub_server import HubServer

pytestmark = pytest.mark.usefixtures("hf_env")

SHA_CHARS = set("0123456789abcdef")


class Progress:
    def __init__(self) -> None:
        self.total = 0

    def __call__(self, n: int) -> None:
        self.total += n


def repo_name() -> str:
    return f"org/adapter-{uuid.uuid4().hex[:10]}"


def adapter_files(directory: Path, *names: str) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in (names or (CONFIG_FILE, WEIGHTS_FILE))}


def same_files(downloaded: Path, original: Path) -> bool:
    names = sorted(os.listdir(downloaded))
    return names == [CONFIG_FILE, WEIGHTS_FILE] and all(
        (downloaded / n).read_bytes() == (original / n).read_bytes() for n in names
    )


def test_resolve_pins_the_commit_sha_and_download_returns_only_the_adapter_files(
    hub_server: HubServer, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    repo = repo_name()
    extra = {"README.md": b"# card", "training_args.bin": b"\x80"}
    files = {**adapter_files(peft_dirs["r8"]), **extra}
    sha = hub_server.publish(repo, files)
    source = HubSource(endpoint=hub_server.url)

    resolved = source.resolve(f"hf://{repo}")
    progress = Progress()
    source.download(resolved, tmp_path, progress)

    assert resolved.revision == sha and len(sha) == 40 and set(sha) <= SHA_CHARS
    assert [f.path for f in resolved.files] == [CONFIG_FILE, WEIGHTS_FILE]
    assert same_files(tmp_path, peft_dirs["r8"])  # no .cache, scratch cache or extra files
    assert not (tmp_path / SCRATCH_CACHE).exists()
    assert progress.total == resolved.total_bytes
    fetched = [r.path for r in hub_server.requests_for(f"/{repo}/resolve/") if r.method == "GET"]
    assert fetched == [f"/{repo}/resolve/{sha}/{name}" for name in (CONFIG_FILE, WEIGHTS_FILE)]


@pytest.mark.parametrize(
    ("suffix", "ref"),
    [
        ("", "main"),
        ("@main", "main"),
        ("@v1.0", "v1.0"),
        ("@refs/pr/1", "refs/pr/1"),
        ("@dev", "dev"),
    ],
)
def test_revisions_resolve_to_the_commit_they_point_at(
    hub_server: HubServer, peft_dirs: dict[str, Path], suffix: str, ref: str
) -> None:
    repo = repo_name()
    shas = {
        "dev": hub_server.publish(repo, adapter_files(peft_dirs["r4"]), branch="dev"),
        "main": hub_server.publish(repo, adapter_files(peft_dirs["r8"]), branch="main"),
    }
    if ref not in shas:
        hub_server.add_ref(repo, ref, shas["main"])

    resolved = HubSource(endpoint=hub_server.url).resolve(f"hf://{repo}{suffix}")

    assert resolved.revision == shas.get(ref, shas["main"])


def test_explicit_sha_revision_resolves_to_itself(
    hub_server: HubServer, peft_dirs: dict[str, Path]
) -> None:
    repo = repo_name()
    old = hub_server.publish(repo, adapter_files(peft_dirs["r4"]))
    hub_server.publish(repo, adapter_files(peft_dirs["r8"]))

    assert HubSource(endpoint=hub_server.url).resolve(f"hf://{repo}@{old}").revision == old


def test_a_new_commit_changes_the_sha_but_a_resolved_download_keeps_its_commit(
    hub_server: HubServer, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    repo = repo_name()
    first = hub_server.publish(repo, adapter_files(peft_dirs["r4"]), branch="exp")
    source = HubSource(endpoint=hub_server.url)
    resolved = source.resolve(f"hf://{repo}@exp")

    second = hub_server.publish(repo, adapter_files(peft_dirs["r8"]), branch="exp")
    source.download(resolved, tmp_path, Progress())

    assert resolved.revision == first != second
    assert source.resolve(f"hf://{repo}@exp").revision == second
    assert same_files(tmp_path, peft_dirs["r4"])  # the branch moved; the download did not


def test_adapter_in_a_subfolder_is_resolved_and_downloaded(
    hub_server: HubServer, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    repo = repo_name()
    hub_server.publish(repo, adapter_files(peft_dirs["r4"]), subfolder="loras/r4")
    source = HubSource(endpoint=hub_server.url)

    source.download(source.resolve(f"hf://{repo}/loras/r4@main"), tmp_path, Progress())

    assert same_files(tmp_path, peft_dirs["r4"])


def test_a_persistent_cache_serves_the_second_download_without_refetching(
    hub_server: HubServer, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    repo = repo_name()
    hub_server.publish(repo, adapter_files(peft_dirs["r8"]))
    source = HubSource(endpoint=hub_server.url, cache_dir=tmp_path / "hub-cache")
    resolved = source.resolve(f"hf://{repo}")
    for attempt in ("first", "second"):
        (tmp_path / attempt).mkdir()
        progress = Progress()
        source.download(resolved, tmp_path / attempt, progress)
        assert same_files(tmp_path / attempt, peft_dirs["r8"])
        assert progress.total == resolved.total_bytes

    gets = [r for r in hub_server.requests_for(f"/{repo}/resolve/") if r.method == "GET"]
    assert len(gets) == 2  # config and weights, once


def test_private_repo_needs_the_token_and_sends_it(
    hub_server: HubServer, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    repo = repo_name()
    hub_server.publish(repo, adapter_files(peft_dirs["r4"]), token="hf_right")
    source = HubSource(endpoint=hub_server.url, token="hf_right")

    source.download(source.resolve(f"hf://{repo}"), tmp_path, Progress())

    assert same_files(tmp_path, peft_dirs["r4"])
    assert {r.authorization for r in hub_server.requests_for(f"/{repo}/")} == {"Bearer hf_right"}


@pytest.mark.parametrize(
    ("token", "message"),
    [(None, "has no Hub token; set HF_TOKEN"), ("hf_wrong", "token was refused")],
    ids=["no-token", "wrong-token"],
)
def test_private_repo_without_the_right_token_is_unauthenticated(
    hub_server: HubServer, peft_dirs: dict[str, Path], token: str | None, message: str
) -> None:
    repo = repo_name()
    hub_server.publish(repo, adapter_files(peft_dirs["r4"]), token="hf_right")

    with pytest.raises(Unauthenticated, match=message):
        HubSource(endpoint=hub_server.url, token=token).resolve(f"hf://{repo}")


def test_a_preload_through_the_store_stages_the_adapter_at_the_sha(
    hub_server: HubServer, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    repo = repo_name()
    sha = hub_server.publish(repo, adapter_files(peft_dirs["r8"]))
    store = AdapterStore(
        tmp_path / "cache", 1 << 30, SourceRegistry([HubSource(endpoint=hub_server.url)])
    )

    manifest = store.preload(f"hf://{repo}", "r8")

    assert manifest.revision == sha and manifest.rank == 8


def test_a_preload_brings_the_adapter_tokenizer_files_into_its_content_id(
    hub_server: HubServer, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter repo with its tokenizer (and a generation config naming its end of turn):
    those files are staged with it, hashed into its content id, and nothing else of the repo."""
    directory = peft_dirs["tokenizer"]
    repo = repo_name()
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    hub_server.publish(repo, {**files, "README.md": b"# card"})
    store = AdapterStore(
        tmp_path / "cache", 1 << 30, SourceRegistry([HubSource(endpoint=hub_server.url)])
    )

    manifest = store.preload(f"hf://{repo}", "tool")

    names = [f.name for f in manifest.files]
    assert names == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert manifest.adapter_id == content_id(directory) != content_id(peft_dirs["r4"])
    staged = tmp_path / "cache" / "adapters" / manifest.adapter_id
    assert all((staged / n).read_bytes() == (directory / n).read_bytes() for n in names)
    assert not (staged / "README.md").exists()


# -- bad inputs ------------------------------------------------------------------------------
Publish = Callable[[HubServer, str, dict[str, Path]], None]


def _publish(*names: str, extra: dict[str, bytes] | None = None) -> Publish:
    def publish(hub: HubServer, repo: str, dirs: dict[str, Path]) -> None:
        hub.publish(repo, {**adapter_files(dirs["r4"], *names), **(extra or {})})

    return publish


def _nothing(hub: HubServer, repo: str, dirs: dict[str, Path]) -> None:
    return None


@pytest.mark.parametrize(
    ("publish", "suffix", "error", "message"),
    [
        (_nothing, "", AdapterNotFound, "no such model repo"),
        (_publish(), "@no-such-branch", AdapterNotFound, "revision 'no-such-branch' not found"),
        (_publish(), "/no/such/dir", AdapterNotFound, "no such folder"),
        (
            _publish(CONFIG_FILE, extra={"adapter_model.bin": b"\x80\x02"}),
            "",
            InvalidAdapter,
            "pickle",
        ),
        (_publish(WEIGHTS_FILE), "", InvalidAdapter, CONFIG_FILE),
        (_publish(CONFIG_FILE), "", InvalidAdapter, WEIGHTS_FILE),
    ],
    ids=[
        "unknown-repo",
        "unknown-revision",
        "unknown-subfolder",
        "pickle-only",
        "no-config",
        "no-weights",
    ],
)
def test_bad_sources_are_refused_at_resolve_without_downloading_a_file(
    hub_server: HubServer,
    peft_dirs: dict[str, Path],
    publish: Publish,
    suffix: str,
    error: type[Exception],
    message: str,
) -> None:
    repo = repo_name()
    publish(hub_server, repo, peft_dirs)

    with pytest.raises(error, match=message):
        HubSource(endpoint=hub_server.url).resolve(f"hf://{repo}{suffix}")

    assert not hub_server.requests_for(f"/{repo}/resolve/")


@pytest.mark.parametrize(
    "uri",
    [
        "hf://",
        "hf://org",
        "hf://org/",
        "hf://org/repo@",
        "hf://org/re po",
        "hf://../repo",
        "hf://org/..",
        "hf://org/repo/../../etc",
        "hf://org/repo/./x",
        "hf://org/repo//x",
        "hf://org/repo/a\\..\\b",
        "hf://org/a--b",
        "hf://datasets/org/repo",
        "hf:/org/repo",
        "s3://org/repo",
    ],
)
def test_malformed_or_traversing_uris_are_invalid_before_any_request(uri: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    with pytest.raises(InvalidArgument):
        HubSource(endpoint=f"http://127.0.0.1:{port}").resolve(uri)


@pytest.mark.parametrize(
    ("uri", "parsed"),
    [
        ("hf://org/repo", ("org/repo", "", "main")),
        ("hf://org/repo/", ("org/repo", "", "main")),
        ("hf://org/repo@v1", ("org/repo", "", "v1")),
        ("hf://org/repo/sub/dir@refs/pr/3", ("org/repo", "sub/dir", "refs/pr/3")),
        ("hf://org/repo@refs%2Fpr%2F3", ("org/repo", "", "refs/pr/3")),
    ],
)
def test_uris_split_into_repo_subfolder_and_revision(
    uri: str, parsed: tuple[str, str, str]
) -> None:
    assert parse_hf_uri(uri) == parsed


def test_unreachable_hub_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    with pytest.raises(SourceUnavailable, match="cannot reach the Hub"):
        HubSource(endpoint=f"http://127.0.0.1:{port}").resolve("hf://org/repo")
