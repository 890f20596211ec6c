"""Adapters in S3 and S3-compatible stores (MinIO, R2): ``s3://bucket/prefix``.

The prefix names a "directory": the adapter is the objects directly under ``prefix/``. Its revision
is the ETag of ``adapter_model.safetensors`` (``<etag>@<version-id>`` in a versioned bucket), and
the download is pinned to that revision: by version id when there is one, otherwise by
``If-Match: <etag>``, so an object overwritten between resolve and download fails the preload
instead of mixing two versions. (Only the weights are pinned; the config is fetched as it is then.)

Credentials come from boto3's standard chain; with ``endpoint_url=None`` boto3 itself honours
``AWS_ENDPOINT_URL``. Transient failures are retried by botocore ("standard" mode).
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from s3transfer.manager import TransferManager
from s3transfer.subscribers import BaseSubscriber

from lorastream.core.adapter_format import WEIGHTS_FILE
from lorastream.core.errors import (
    AdapterNotFound,
    InvalidAdapter,
    InvalidArgument,
    LorastreamError,
)
from lorastream.store.digesting import StreamDigests
from lorastream.store.sources.base import (
    AdapterSource,
    ProgressCallback,
    RemoteFile,
    ResolvedSource,
    select_adapter_files,
)
from lorastream.store.sources.s3_errors import s3_error

log = logging.getLogger(__name__)

MIB = 1 << 20

# Legacy S3 rules (what MinIO and R2 accept is a subset): letters, digits, '.', '_', '-'.
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{2,254}$")



def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b")``; InvalidArgument on anything unsafe.

    Keys are taken literally (S3 URIs are not percent-encoded). A prefix may not start with
    ``/``, hold empty, ``.`` or ``..`` segments, backslashes or control characters.
    """
    if not uri.lower().startswith("s3://"):
        raise InvalidArgument(f"{uri}: not an s3:// URI; expected s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket):
        raise InvalidArgument(
            f"{uri}: {bucket!r} is not a valid bucket name; expected s3://bucket/prefix with a "
            "bucket of 3+ letters, digits, '.', '-' or '_'"
        )
    if prefix.endswith("/"):
        prefix = prefix[:-1]
    if prefix.startswith("/"):
        raise InvalidArgument(
            f"{uri}: the key prefix starts with '/'; write s3://{bucket}/path/to/adapter"
        )
    if prefix:
        for segment in prefix.split("/"):
            _check_segment(uri, segment)
    return bucket, prefix


def _check_segment(uri: str, segment: str) -> None:
    if segment in ("", ".", ".."):
        raise InvalidArgument(
            f"{uri}: empty, '.' and '..' path segments are refused (path traversal); name the "
            "adapter's prefix plainly, e.g. s3://bucket/adapters/my-adapter"
        )
    if "\\" in segment or any(ord(c) < 32 or ord(c) == 127 for c in segment):
        raise InvalidArgument(
            f"{uri}: backslashes and control characters are refused in S3 keys"
        )


def _check_member(uri: str, key: str, name: str) -> None:
    """``name`` is a listed object's path relative to the prefix: it must stay in the dest dir."""
    if name in (".", "..") or "/" in name or "\\" in name or any(ord(c) < 32 for c in name):
        raise InvalidArgument(
            f"{uri}: object {key!r} would be written outside the staging directory; refusing "
            "this prefix (rename or delete that object)"
        )


def format_revision(etag: str, version_id: str | None) -> str:
    etag = etag.strip('"')
    return f"{etag}@{version_id}" if version_id and version_id != "null" else etag


def parse_revision(revision: str) -> tuple[str, str | None]:
    """The inverse of :func:`format_revision`: ``(etag, version_id or None)``."""
    etag, _, version_id = revision.partition("@")
    return etag, version_id or None


class _PinnedTransferManager(TransferManager):
    """A TransferManager that also forwards ``IfMatch`` on single-request downloads.

    s3transfer sends ``IfMatch`` on ranged parts by itself once the ETag is known, but not on a
    download done in one GET; allowing the argument pins both paths to the resolved ETag.
    """

    ALLOWED_DOWNLOAD_ARGS: ClassVar[list[str]] = [
        *TransferManager.ALLOWED_DOWNLOAD_ARGS, "IfMatch"]


class _Known(BaseSubscriber):
    """Hands s3transfer the size (and ETag) already listed, and relays progress."""

    def __init__(self, size: int, etag: str | None, progress: ProgressCallback) -> None:
        self._size = size
        self._etag = etag
        self._progress = progress

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self._size)
        if self._etag is not None:
            future.meta.provide_object_etag(self._etag)

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        self._progress(bytes_transferred)  # negative when s3transfer rewinds a retried part


class S3Source(AdapterSource):
    """Fetches PEFT directories from S3 with multipart, concurrent downloads and retries.

    ``session`` lets a caller supply its own boto3 session (a profile, or event hooks in tests);
    by default a fresh ``boto3.session.Session()`` with the standard credential chain is used.
    """

    schemes = ("s3",)

    def __init__(
        self,
        endpoint_url: str | None = None,
        region: str | None = None,
        max_concurrency: int = 8,
        multipart_threshold: int = 8 * MIB,
        multipart_chunksize: int = 8 * MIB,
        max_attempts: int = 5,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        *,
        session: boto3.session.Session | None = None,
    ) -> None:
        if max_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency and max_attempts must be at least 1")
        self._endpoint_url = endpoint_url
        self._region = region
        self._max_attempts = max_attempts
        self._session = session
        self._config = Config(
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, max_concurrency + 2),
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            num_download_attempts=max_attempts,
        )
        self._client: Any = None
        self._client_lock = threading.Lock()

    # -- the client -------------------------------------------------------------------------
    def _s3(self) -> Any:
        """The boto3 client, made on first use (so the credential chain is read then)."""
        with self._client_lock:
            if self._client is None:
                session = self._session or boto3.session.Session()
                self._client = session.client(
                    "s3",
                    endpoint_url=self._endpoint_url,
                    region_name=self._region,
                    config=self._config,
                )
            return self._client

    def _where(self) -> str:
        client = self._client
        return client.meta.endpoint_url if client is not None else (self._endpoint_url or "AWS")

    # -- AdapterSource ----------------------------------------------------------------------
    def resolve(self, uri: str) -> ResolvedSource:
        bucket, prefix = parse_s3_uri(uri)
        directory = f"{prefix}/" if prefix else ""
        try:
            listing, etags, sub_prefixes = self._list(uri, bucket, directory)
        except Exception as err:
            self._raise_mapped(err, uri, "the listing")
        if not listing and not sub_prefixes:
            raise AdapterNotFound(
                f"{uri}: no objects under s3://{bucket}/{directory} (endpoint {self._where()}); "
                "check the prefix: the URI names the directory that holds adapter_config.json "
                "and adapter_model.safetensors"
            )
        try:
            files = select_adapter_files(listing, uri)
        except InvalidAdapter as err:
            if not sub_prefixes:
                raise
            raise InvalidAdapter(
                f"{err} It holds sub-prefixes ({', '.join(sorted(sub_prefixes)[:5])}); point the "
                "URI at the one that holds the adapter."
            ) from err
        key = directory + WEIGHTS_FILE
        try:
            head = self._s3().head_object(Bucket=bucket, Key=key, IfMatch=etags[WEIGHTS_FILE])
        except Exception as err:
            self._raise_mapped(err, uri, key)
        revision = format_revision(head["ETag"], head.get("VersionId"))
        log.debug("resolved %s to revision %s", uri, revision)
        return ResolvedSource(uri=uri, revision=revision, files=files)

    def _list(
        self, uri: str, bucket: str, directory: str
    ) -> tuple[dict[str, int], dict[str, str], list[str]]:
        """Objects directly under ``directory``: (name -> size, name -> ETag, sub-prefixes)."""
        sizes: dict[str, int] = {}
        etags: dict[str, str] = {}
        sub_prefixes: list[str] = []
        pages = self._s3().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=directory, Delimiter="/"
        )
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"][len(directory) :]
                if not name:
                    continue  # the "directory marker" some tools write
                _check_member(uri, obj["Key"], name)
                sizes[name] = int(obj["Size"])
                etags[name] = obj["ETag"]
            sub_prefixes.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
        return sizes, etags, sub_prefixes

    def download(self, resolved: ResolvedSource, dest: Path, progress: ProgressCallback) -> None:
        self._download(resolved, dest, progress, None)

    def download_digested(
        self,
        resolved: ResolvedSource,
        dest: Path,
        progress: ProgressCallback,
        digests: StreamDigests,
    ) -> None:
        """The files one after the other (the config first, then the weights, as the content id
        hashes them), each written in order through ``digests``: s3transfer still fetches the
        weights' parts concurrently and writes them in order from its in-memory window, so the
        hashing runs on its writer thread while the parts arrive."""
        self._download(resolved, dest, progress, digests)

    def _download(
        self,
        resolved: ResolvedSource,
        dest: Path,
        progress: ProgressCallback,
        digests: StreamDigests | None,
    ) -> None:
        bucket, prefix = parse_s3_uri(resolved.uri)
        directory = f"{prefix}/" if prefix else ""
        etag, version_id = parse_revision(resolved.revision)
        manager = _PinnedTransferManager(self._s3(), self._transfer)
        futures = []
        failed = False
        try:
            for remote in resolved.files:
                target = _target(dest, resolved.uri, remote)
                writer = None if digests is None else digests.writer(remote.path, remote.size,
                                                                     target)
                extra: dict[str, str] = {}
                known_etag = None
                if remote.path == WEIGHTS_FILE and etag:
                    known_etag = f'"{etag}"'
                    extra["IfMatch"] = known_etag
                    if version_id:
                        extra["VersionId"] = version_id
                key = directory + remote.path
                future = manager.download(
                    bucket,
                    key,
                    str(target) if writer is None else writer,
                    extra_args=extra,
                    subscribers=[_Known(remote.size, known_etag, progress)],
                )
                futures.append((key, future))
                if writer is not None:  # in order: this file completes before the next starts
                    try:
                        self._wait(future, resolved.uri, key)
                    finally:
                        writer.close()
            for key, future in futures:
                self._wait(future, resolved.uri, key)
        except BaseException:
            failed = True
            raise
        finally:
            manager.shutdown(cancel=failed)
        log.debug("downloaded %d objects of %s", len(futures), resolved.uri)

    def _wait(self, future: Any, uri: str, key: str) -> None:
        try:
            future.result()
        except Exception as err:
            self._raise_mapped(err, uri, key)

    # -- errors (s3_errors.py) ---------------------------------------------------------------
    def _raise_mapped(self, err: Exception, uri: str, what: str) -> NoReturn:
        """Raise a domain error that says what to fix; local disk errors (ENOSPC) pass through."""
        if isinstance(err, LorastreamError) or (isinstance(err, OSError) and err.errno is not None):
            raise err
        raise s3_error(err, uri, what, self._where(), self._max_attempts) from err


def _target(dest: Path, uri: str, remote: RemoteFile) -> Path:
    """``dest / remote.path``, refused if it would land outside ``dest``."""
    _check_member(uri, remote.path, remote.path)
    target = dest / remote.path
    if target.resolve().parent != dest.resolve():
        raise InvalidArgument(f"{uri}: {remote.path!r} would be written outside {dest}")
    return target
