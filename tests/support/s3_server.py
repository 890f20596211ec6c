"""S3 endpoints for tests: moto's real S3 server on loopback, and an endpoint that always fails.

moto's server speaks the S3 REST protocol; tests reach it with the real boto3 client (path-style
addressing, dummy credentials). :class:`FailingS3Endpoint` answers every request with one S3 error
and counts the requests, to show that retries happen and how many.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoS3Server:
    """moto's ThreadedMotoServer on 127.0.0.1, port 0."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""

    def start(self) -> MotoS3Server:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self._server.stop()

    def client(self) -> Any:
        """A boto3 S3 client for this server (dummy credentials given explicitly)."""
        return boto3.session.Session(
            aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=DUMMY_CREDENTIALS["AWS_DEFAULT_REGION"],
        ).client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(s3={"addressing_style": "path"}),
        )

    @contextmanager
    def iam_enforced(self) -> Iterator[None]:
        """While inside, moto checks credentials against its IAM (so "test" keys are refused)."""
        self._reset_auth(0)
        try:
            yield
        finally:
            self._reset_auth(float("inf"))

    def _reset_auth(self, count: float) -> None:
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/reset-auth", data=str(count).encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},  # a form type would hide the body from moto
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()


def upload_dir(
    client: Any,
    local_dir: Path,
    bucket: str,
    prefix: str,
    *,
    only: tuple[str, ...] | None = None,
    multipart_chunksize: int | None = None,
) -> dict[str, str]:
    """Upload the files of ``local_dir`` to ``s3://bucket/prefix/``; returns name -> ETag.

    ``only`` limits the upload to those file names. ``multipart_chunksize`` (at least 5 MiB, S3's
    smallest part) uploads files larger than it in parts, so their ETags are multipart ETags.
    """
    chunk = multipart_chunksize or 64 << 20
    config = TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk)
    etags: dict[str, str] = {}
    for path in sorted(local_dir.iterdir()):
        if not path.is_file() or (only is not None and path.name not in only):
            continue
        key = f"{prefix}/{path.name}" if prefix else path.name
        client.upload_file(str(path), bucket, key, Config=config)
        etags[path.name] = client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
    return etags


class _FailingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _FailingServer

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        with self.server.lock:
            self.server.requests += 1
        status, code = self.server.status, self.server.code
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{code} from the test endpoint</Message></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _FailingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, status: int, code: str) -> None:
        super().__init__(("127.0.0.1", 0), _FailingHandler)
        self.status = status
        self.code = code
        self.requests = 0
        self.lock = threading.Lock()


class FailingS3Endpoint:
    """An HTTP endpoint on 127.0.0.1, port 0, that answers every request with one S3 error."""

    def __init__(self, status: int = 503, code: str = "ServiceUnavailable") -> None:
        self._server = _FailingServer(status, code)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def requests(self) -> int:
        with self._server.lock:
            return self._server.requests

    def __enter__(self) -> FailingS3Endpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
