"""S3Source against moto's real S3 server on loopback, with the real boto3 client."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.adapter_validation import content_id
from lorastream.core.errors import (
    AdapterNotFound,
    InvalidAdapter,
    InvalidArgument,
    SourceUnavailable,
)
from lorastream.store.sources import SourceRegistry
from lorastream.store.sources.s3 import S3Source, parse_s3_uri
from lorastream.store.store import AdapterStore
from tests.support.s3_server import FailingS3Endpoint, MotoS3Server, upload_dir

pytestmark = pytest.mark.usefixtures("aws_env")

MIB = 1 << 20


class Progress:
    """A thread-safe progress sink (s3transfer reports from several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self.calls = 0

    def __call__(self, n: int) -> None:
        with self._lock:
            self.total += n
            self.calls += 1


def recording_session(calls: list[tuple[str, str | None]]) -> boto3.session.Session:
    """A boto3 session that records (operation, Range) of every GetObject/HeadObject it sends."""
    session = boto3.session.Session()

    def record(params: dict[str, object], model: object, **_: object) -> None:
        calls.append((getattr(model, "name", "?"), params.get("Range")))  # type: ignore[arg-type]  # botocore's params: a plain dict

    session.events.register("before-parameter-build.s3.GetObject", record)
    session.events.register("before-parameter-build.s3.HeadObject", record)
    return session


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_files(downloaded: Path, original: Path) -> bool:
    names = sorted(os.listdir(downloaded))
    return names == [CONFIG_FILE, WEIGHTS_FILE] and all(
        (downloaded / n).read_bytes() == (original / n).read_bytes() for n in names
    )


@pytest.mark.parametrize("suffix", ["", "/"], ids=["plain", "trailing-slash"])
def test_resolve_pins_the_weights_etag_and_download_returns_the_same_bytes(
    moto_s3: MotoS3Server, bucket: str, peft_dirs: dict[str, Path], tmp_path: Path, suffix: str
) -> None:
    adapter = peft_dirs["r8"]
    etags = upload_dir(moto_s3.client(), adapter, bucket, "adapters/r8")
    source = S3Source(endpoint_url=moto_s3.endpoint_url)

    resolved = source.resolve(f"s3://{bucket}/adapters/r8{suffix}")

    assert resolved.revision == etags[WEIGHTS_FILE]
    assert {f.path: f.size for f in resolved.files} == {
        n: (adapter / n).stat().st_size for n in (CONFIG_FILE, WEIGHTS_FILE)
    }
    progress = Progress()
    source.download(resolved, tmp_path, progress)
    assert same_files(tmp_path, adapter)
    assert progress.total == resolved.total_bytes


def test_aws_endpoint_url_from_the_environment_is_honoured_by_boto3(
    moto_s3: MotoS3Server,
    bucket: str,
    peft_dirs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    upload_dir(moto_s3.client(), peft_dirs["r4"], bucket, "r4")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)
    source = S3Source()  # no endpoint: boto3 reads AWS_ENDPOINT_URL itself

    source.download(source.resolve(f"s3://{bucket}/r4"), tmp_path, Progress())

    assert same_files(tmp_path, peft_dirs["r4"])


def test_large_weights_download_in_concurrent_ranged_parts_with_full_progress(
    moto_s3: MotoS3Server, bucket: str, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    adapter = peft_dirs["six-mib"]
    size = (adapter / WEIGHTS_FILE).stat().st_size
    assert size > 6 * MIB - 1
    etags = upload_dir(moto_s3.client(), adapter, bucket, "big", multipart_chunksize=5 * MIB)
    calls: list[tuple[str, str | None]] = []
    source = S3Source(
        endpoint_url=moto_s3.endpoint_url,
        multipart_threshold=MIB,
        multipart_chunksize=MIB,
        max_concurrency=4,
        session=recording_session(calls),
    )

    resolved = source.resolve(f"s3://{bucket}/big")
    progress = Progress()
    source.download(resolved, tmp_path, progress)

    assert resolved.revision == etags[WEIGHTS_FILE] and resolved.revision.endswith("-2")
    ranged = [r for op, r in calls if op == "GetObject" and r is not None]
    assert len(ranged) == -(-size // MIB)  # one ranged GET per MiB part
    assert same_files(tmp_path, adapter)
    assert progress.total == resolved.total_bytes


def test_new_weights_change_the_revision(
    moto_s3: MotoS3Server, bucket: str, peft_dirs: dict[str, Path]
) -> None:
    client = moto_s3.client()
    upload_dir(client, peft_dirs["r4"], bucket, "a")
    source = S3Source(endpoint_url=moto_s3.endpoint_url)
    first = source.resolve(f"s3://{bucket}/a").revision

    upload_dir(client, peft_dirs["r8"], bucket, "a")

    assert source.resolve(f"s3://{bucket}/a").revision not in ("", first)


def test_overwrite_between_resolve_and_download_fails_instead_of_mixing(
    moto_s3: MotoS3Server, bucket: str, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    client = moto_s3.client()
    upload_dir(client, peft_dirs["r4"], bucket, "a")
    source = S3Source(endpoint_url=moto_s3.endpoint_url)
    resolved = source.resolve(f"s3://{bucket}/a")
    upload_dir(client, peft_dirs["r8"], bucket, "a", only=(WEIGHTS_FILE,))

    with pytest.raises(SourceUnavailable, match="changed after its revision was resolved"):
        source.download(resolved, tmp_path, Progress())


def test_versioned_bucket_downloads_the_resolved_version_after_an_overwrite(
    moto_s3: MotoS3Server, bucket: str, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    client = moto_s3.client()
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    upload_dir(client, peft_dirs["r8"], bucket, "a")
    version = client.head_object(Bucket=bucket, Key=f"a/{WEIGHTS_FILE}")["VersionId"]
    source = S3Source(endpoint_url=moto_s3.endpoint_url)
    resolved = source.resolve(f"s3://{bucket}/a")
    upload_dir(client, peft_dirs["r4"], bucket, "a", only=(WEIGHTS_FILE,))

    source.download(resolved, tmp_path, Progress())

    assert resolved.revision.endswith(f"@{version}")
    weights = (tmp_path / WEIGHTS_FILE).read_bytes()
    assert weights == (peft_dirs["r8"] / WEIGHTS_FILE).read_bytes()


def test_a_preload_through_the_store_stages_the_adapter_with_its_etag(
    moto_s3: MotoS3Server, bucket: str, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    etags = upload_dir(
        moto_s3.client(), peft_dirs["six-mib"], bucket, "big", multipart_chunksize=5 * MIB
    )
    sources = SourceRegistry([S3Source(endpoint_url=moto_s3.endpoint_url, multipart_threshold=MIB)])
    store = AdapterStore(tmp_path / "cache", 1 << 30, sources)

    manifest = store.preload(f"s3://{bucket}/big", "big")

    assert manifest.revision == etags[WEIGHTS_FILE]
    assert manifest.rank == 64 and len(manifest.tensors) == 6 * 7 * 2


def test_a_preload_brings_the_adapter_tokenizer_files_into_its_content_id(
    moto_s3: MotoS3Server, bucket: str, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter saved beside its tokenizer (and a generation config naming its end of turn):
    those files are staged with it, hashed into its content id, and nothing else of the prefix."""
    directory = peft_dirs["tokenizer"]
    upload_dir(moto_s3.client(), directory, bucket, "tool")
    moto_s3.client().put_object(Bucket=bucket, Key="tool/README.md", Body=b"# card")
    sources = SourceRegistry([S3Source(endpoint_url=moto_s3.endpoint_url)])
    store = AdapterStore(tmp_path / "cache", 1 << 30, sources)

    manifest = store.preload(f"s3://{bucket}/tool", "tool")

    names = [f.name for f in manifest.files]
    assert names == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    assert manifest.adapter_id == content_id(directory) != content_id(peft_dirs["r4"])
    staged = tmp_path / "cache" / "adapters" / manifest.adapter_id
    assert all((staged / n).read_bytes() == (directory / n).read_bytes() for n in names)
    assert not (staged / "README.md").exists()


# -- bad inputs ------------------------------------------------------------------------------
Setup = Callable[[MotoS3Server, str, dict[str, Path]], str]


def _upload(*names: str, to: str = "a") -> Setup:
    """Upload some files of the r4 adapter under ``to``; the URI under test is s3://bucket/a."""

    def setup(server: MotoS3Server, bucket: str, dirs: dict[str, Path]) -> str:
        upload_dir(server.client(), dirs["r4"], bucket, to, only=names)
        return f"s3://{bucket}/a"

    return setup


def _put(objects: dict[str, bytes]) -> Setup:
    """Put these objects; the URI under test is s3://bucket/a."""

    def setup(server: MotoS3Server, bucket: str, dirs: dict[str, Path]) -> str:
        client = server.client()
        for key, body in objects.items():
            client.put_object(Bucket=bucket, Key=key, Body=body)
        return f"s3://{bucket}/a"

    return setup


def _missing_bucket(server: MotoS3Server, bucket: str, dirs: dict[str, Path]) -> str:
    return f"s3://{bucket}-absent/a"


@pytest.mark.parametrize(
    ("setup", "error", "message"),
    [
        (_missing_bucket, AdapterNotFound, "bucket does not exist"),
        (_upload(CONFIG_FILE, WEIGHTS_FILE, to="elsewhere"), AdapterNotFound, "no objects"),
        (
            _put({"a/adapter_model.bin": b"\x80\x02pickle", "a/adapter_config.json": b"{}"}),
            InvalidAdapter,
            "pickle",
        ),
        (_upload(WEIGHTS_FILE), InvalidAdapter, CONFIG_FILE),
        (_upload(CONFIG_FILE), InvalidAdapter, WEIGHTS_FILE),
        (_upload(CONFIG_FILE, WEIGHTS_FILE, to="a/nested"), InvalidAdapter, "sub-prefixes"),
        (
            _put({"a/adapter_config.json": b"{}", "a/..": b"x"}),
            InvalidArgument,
            "outside the staging",
        ),
    ],
    ids=[
        "missing-bucket",
        "missing-prefix",
        "pickle-only",
        "missing-config",
        "missing-weights",
        "adapter-one-level-down",
        "object-named-dotdot",
    ],
)
def test_bad_sources_are_refused_at_resolve_without_fetching_any_object(
    moto_s3: MotoS3Server,
    bucket: str,
    peft_dirs: dict[str, Path],
    setup: Setup,
    error: type[Exception],
    message: str,
) -> None:
    uri = setup(moto_s3, bucket, peft_dirs)
    calls: list[tuple[str, str | None]] = []
    source = S3Source(endpoint_url=moto_s3.endpoint_url, session=recording_session(calls))

    with pytest.raises(error, match=message):
        source.resolve(uri)

    assert not [op for op, _ in calls if op == "GetObject"]


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bkt/adapters/../secrets",
        "s3://bkt/../etc",
        "s3://bkt//etc/passwd",
        "s3://bkt/a/./b",
        "s3://bkt/a//b",
        "s3://bkt/a\\..\\b",
        "s3://bkt/a\x00b",
        "s3://",
        "s3://b",
        "s3://bucket with space/a",
        "s3:/bkt/a",
        "https://bkt/a",
    ],
)
def test_malformed_or_traversing_uris_are_invalid_before_any_request(uri: str) -> None:
    source = S3Source(endpoint_url=f"http://127.0.0.1:{closed_port()}", max_attempts=1)

    with pytest.raises(InvalidArgument):
        source.resolve(uri)


@pytest.mark.parametrize(
    ("uri", "bucket", "prefix"),
    [("s3://bkt/a/b", "bkt", "a/b"), ("s3://bkt/a/b/", "bkt", "a/b"), ("s3://bkt", "bkt", "")],
)
def test_uris_split_into_bucket_and_prefix(uri: str, bucket: str, prefix: str) -> None:
    assert parse_s3_uri(uri) == (bucket, prefix)


def test_dead_endpoint_is_unavailable_after_quick_retries() -> None:
    port = closed_port()
    source = S3Source(
        endpoint_url=f"http://127.0.0.1:{port}", max_attempts=2, connect_timeout=0.5, read_timeout=1
    )
    started = time.monotonic()

    with pytest.raises(SourceUnavailable, match=rf"cannot reach S3 at http://127.0.0.1:{port}"):
        source.resolve("s3://bkt/a")

    assert time.monotonic() - started < 10


@pytest.mark.parametrize("attempts", [1, 3])
def test_server_errors_are_retried_then_reported_unavailable(attempts: int) -> None:
    with FailingS3Endpoint(503, "ServiceUnavailable") as endpoint:
        source = S3Source(endpoint_url=endpoint.endpoint_url, max_attempts=attempts)

        with pytest.raises(SourceUnavailable, match=f"after {attempts} attempts"):
            source.resolve("s3://bkt/a")

        assert endpoint.requests == attempts


def test_refused_credentials_say_to_check_credentials(
    moto_s3: MotoS3Server, bucket: str, peft_dirs: dict[str, Path]
) -> None:
    upload_dir(moto_s3.client(), peft_dirs["r4"], bucket, "a")
    source = S3Source(endpoint_url=moto_s3.endpoint_url, max_attempts=1)

    with moto_s3.iam_enforced(), pytest.raises(SourceUnavailable, match="check credentials"):
        source.resolve(f"s3://{bucket}/a")
