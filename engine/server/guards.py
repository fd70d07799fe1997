"""ASGI middleware that guards `kvstash serve` before a request reaches a route:
an OpenAI-style API key (`Authorization: Bearer KEY`) and a request body size limit.

Both are plain ASGI wrappers (not Starlette's BaseHTTPMiddleware) so streamed
responses pass through untouched; this module imports Starlette only when a limit
trips, so the CLI can read its defaults on machines without the serving stack. Each answer they give uses the OpenAI error shape.
`create_app` installs them: the key check outermost, so a client without the key
never gets a body read or a size answer.
"""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING

from engine.server.responses import error_body

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: the default of `kvstash serve --max-request-bytes`: a 128k-token prompt sent as a
#: list of token ids (about 7 bytes each) or as JSON-escaped text still fits
DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024


async def _send_error(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                # the body was not read: the connection cannot carry another request
                (b"connection", b"close"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def requires_api_key(path: str) -> bool:
    """Every OpenAI route (`/v1/...`, unknown ones too, so a 404 tells nothing to a client
    without the key) and `/metrics`; `/health` stays open for load balancers and probes."""
    return path == "/v1" or path.startswith("/v1/") or path == "/metrics"


class ApiKeyMiddleware:
    """Answers 401 (`code: invalid_api_key`) unless the request carries
    `Authorization: Bearer <api_key>` on a path `requires_api_key` names. The key is
    compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._expected = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest takes its time from the expected value, not from where they differ
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and requires_api_key(scope["path"]) and not self._authorized(scope):
            body = error_body(
                "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                "invalid_request_error",
                code="invalid_api_key",
            )
            await _send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413: at once from `Content-Length`
    (nothing of the body is read), else (a chunked body) as soon as the bytes read pass
    the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"the request size limit must be >= 1 byte, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> dict:
        return error_body(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes "
            "(kvstash serve --max-request-bytes)",
            "invalid_request_error",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if length is not None:
            if not length.isdigit():
                body = error_body("invalid Content-Length header", "invalid_request_error")
                await _send_error(send, 400, body)
                return
            if int(length) > self.max_bytes:
                await _send_error(send, 413, self._too_large())
                return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    from starlette.exceptions import HTTPException

                    # FastAPI re-raises an HTTPException met while reading the body; the
                    # app's handler answers it in the OpenAI shape
                    raise HTTPException(413, self._too_large()["error"]["message"])
            return message

        await self.app(scope, limited_receive, send)
