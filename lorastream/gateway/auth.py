"""Who may call what on the gateway: the operate token and the inference API keys.

- Operator endpoints (``/v1/adapters...``, vLLM's ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter``) need the operate token (``GatewaySettings.token``) when the
  gateway has one; the vLLM ones answer an API key 403 (it lacks the scope), others 401.
- The OpenAI endpoints (completions, chat completions, models) need one of the API keys
  (``GatewaySettings.api_keys``), or the operate token, when the gateway has any key; OpenAI
  clients send them as ``Authorization: Bearer <key>``.
- ``/v1/models`` shows adapter sources only to a request carrying the operate token.

Keys are compared in constant time (``hmac.compare_digest``) and never logged.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from lorastream.core.auth import bearer_of
from lorastream.gateway.http_errors import ApiError
from lorastream.gateway.state import gateway_state


def _presented(request: Request) -> str | None:
    return bearer_of(request.headers.get("authorization"))


def _equal(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode(), expected.encode())


def is_operator(request: Request) -> bool:
    """True when the request carries the gateway's operate token (False when it has none)."""
    token = gateway_state(request).settings.token
    presented = _presented(request)
    if not token or presented is None:
        return False
    return _equal(presented, token)


def _missing_or_wrong(request: Request, what: str) -> ApiError:
    if request.headers.get("authorization") is None:
        return ApiError(401, f"this endpoint needs 'Authorization: Bearer <{what}>'",
                        "authentication_error", code="missing_api_key")
    return ApiError(401, f"the bearer token is not a valid {what}", "authentication_error",
                    code="invalid_api_key")


def require_operator(request: Request) -> None:
    """401 unless the request carries the operate token (when the gateway has one)."""
    if gateway_state(request).settings.token and not is_operator(request):
        raise _missing_or_wrong(request, "operate token")


def _holds_api_key(request: Request) -> bool:
    presented = _presented(request)
    # every key compared, so the time taken does not tell which one is closest
    matched = [presented is not None and _equal(presented, key)
               for key in gateway_state(request).settings.api_keys]
    return any(matched)


def require_api_key(request: Request) -> None:
    """401 unless the request carries an API key or the operate token (when keys are set)."""
    keys = gateway_state(request).settings.api_keys
    if not keys or is_operator(request):
        return
    if not _holds_api_key(request):
        raise _missing_or_wrong(request, "API key")


def require_operate_scope(request: Request) -> None:
    """As :func:`require_operator`, but an API key (it may only infer) is refused with 403, as
    a known caller without the scope, rather than 401."""
    if not gateway_state(request).settings.token or is_operator(request):
        return
    if _holds_api_key(request):
        raise ApiError(403, "this endpoint changes which adapters are served and needs the "
                       "operate token; an API key may only call the inference endpoints",
                       "permission_error", code="insufficient_scope")
    raise _missing_or_wrong(request, "operate token")
