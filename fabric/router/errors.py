"""OpenAI-style error answers of the proxy.

Every failure reaches the client as JSON, in the shape vLLM's and OpenAI's
servers use, so clients parse it the same way::

    {"error": {"message": "...", "type": "invalid_request_error",
               "param": "prompt", "code": 400}}

``ProxyError`` carries such an answer through the proxy's code; the route
wrappers turn it into a response.
"""

from __future__ import annotations

import json

from starlette.responses import Response

from fabric.errors import FabricError

INVALID_REQUEST = "invalid_request_error"
UPSTREAM_ERROR = "upstream_error"
UPSTREAM_TIMEOUT = "upstream_timeout"
UNAVAILABLE = "service_unavailable"
INTERNAL = "internal_error"
UNAUTHORIZED = "authentication_error"


class ProxyError(FabricError):
    """A failure the client should see as ``status`` with an OpenAI error body."""

    def __init__(
        self, status: int, message: str, type: str = INVALID_REQUEST, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.request_id: str | None = None
        # NOTE: True when nothing reached the engine (connection refused), so
        # the request may go to another engine.
        self.retryable = False

    def response(self) -> Response:
        """The JSON response the client gets (with ``X-Request-Id`` once known)."""
        response = error_response(self.status, self.message, self.type, self.param)
        if self.request_id is not None:
            response.headers["x-request-id"] = self.request_id
        return response


def error_body(status: int, message: str, type: str, param: str | None = None) -> bytes:
    """The JSON bytes of an OpenAI-style error."""
    error = {"message": message, "type": type, "param": param, "code": status}
    return json.dumps({"error": error}).encode()


def error_response(
    status: int, message: str, type: str = INVALID_REQUEST, param: str | None = None
) -> Response:
    """An OpenAI-style error response with ``status``."""
    return Response(error_body(status, message, type, param), status, media_type="application/json")


def sse_error(status: int, message: str, type: str) -> bytes:
    """An error as one server-sent event, for failures after a stream has started."""
    return b"data: " + error_body(status, message, type) + b"\n\n"


def bad_request(message: str, param: str | None = None) -> ProxyError:
    """A 400 the client caused; no engine was contacted."""
    return ProxyError(400, message, INVALID_REQUEST, param)
