"""What an S3 failure means for the user: boto3's and s3transfer's errors as lorastream's domain
errors (``s3.py``), each saying what to fix (the bucket name, credentials, the region, the
endpoint, a revision that changed)."""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError

from lorastream.core.errors import (
    AdapterNotFound,
    InvalidArgument,
    LorastreamError,
    SourceUnavailable,
)

_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "NotFound", "404"}
_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "AccountProblem",
    "403",
}
_WRONG_REGION = {
    "PermanentRedirect",
    "AuthorizationHeaderMalformed",
    "IllegalLocationConstraintException",
    "301",
}


def s3_error(
    err: Exception, uri: str, what: str, where: str, max_attempts: int
) -> LorastreamError:
    """The domain error for a boto3/s3transfer failure on ``what`` of ``uri`` (S3 at ``where``,
    after ``max_attempts`` tries by botocore), saying what to fix."""
    if isinstance(err, ClientError):
        error = err.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        message = error.get("Message", "") or str(err)
        if code == "NoSuchBucket":
            return AdapterNotFound(
                f"{uri}: the bucket does not exist at {where}; check the bucket name and the "
                "S3 endpoint (AWS_ENDPOINT_URL)"
            )
        if code in _NOT_FOUND:
            return AdapterNotFound(f"{uri}: {what} not found at {where}")
        if code in _DENIED:
            return SourceUnavailable(
                f"{uri}: S3 at {where} refused {what} ({code}: {message}); check credentials: "
                "the store uses the standard AWS chain (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role), which must allow "
                "s3:ListBucket and s3:GetObject here"
            )
        if code in ("PreconditionFailed", "412"):
            return changed(uri, what)
        if code in _WRONG_REGION:
            return SourceUnavailable(
                f"{uri}: the bucket is in another region ({code}); set the store's S3 region "
                "(AWS_DEFAULT_REGION) to the bucket's region"
            )
        if status >= 500 or code in ("SlowDown", "InternalError", "ServiceUnavailable"):
            return SourceUnavailable(
                f"{uri}: S3 at {where} kept failing on {what} after {max_attempts} "
                f"attempts ({status} {code}); retry later"
            )
        return SourceUnavailable(f"{uri}: S3 at {where} failed on {what}: {code}: {message}")
    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return SourceUnavailable(
            f"{uri}: no usable AWS credentials ({err}); check credentials: set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role"
        )
    if isinstance(err, (BotoConnectionError, HTTPClientError, RetriesExceededError)):
        return SourceUnavailable(
            f"{uri}: cannot reach S3 at {where} after {max_attempts} attempts ({err}); "
            "check the endpoint (AWS_ENDPOINT_URL) and the network"
        )
    if isinstance(err, S3DownloadFailedError):
        return changed(uri, what)
    if isinstance(err, ParamValidationError):
        return InvalidArgument(f"{uri}: {err}")
    if isinstance(err, BotoCoreError):
        return SourceUnavailable(f"{uri}: S3 at {where} failed on {what}: {err}")
    return SourceUnavailable(f"{uri}: S3 download of {what} failed: {err!r}")


def changed(uri: str, what: str) -> SourceUnavailable:
    return SourceUnavailable(
        f"{uri}: {what} changed after its revision was resolved (If-Match failed); preload "
        "again to fetch the new revision"
    )
