"""MLflow's scoring server for a capflow model behind request limits, as ``uvicorn tasks.serving_app:app`` (what
:func:`tasks.model_server.mlflow_model_server` and ``capflow bench serve`` start).

The app is MLflow's own (``mlflow.pyfunc.scoring_server.init``: ``/ping``, ``/health``, ``/version``,
``/invocations`` and their answers) wrapped in an ASGI layer that bounds what a request may cost before MLflow
parses it:

- a body over ``CAPFLOW_MAX_REQUEST_BYTES`` (default 96 MiB: 64 images of 20 MB, base64) is answered 413 - from its
  ``Content-Length`` before a byte is read, or as soon as a chunked body passes the limit - instead of being read
  whole and parsed;
- a JSON body nested past what Python's parser can take (thousands of ``[``/``{``) is answered 400, not 500 with a
  RecursionError.

The model comes from ``_MLFLOW_SERVER_MODEL_PATH`` (a local MLflow Model folder), as for MLflow's own app.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

MAX_REQUEST_BYTES = 96 * 2**20
#: bodies with more brackets than this are parsed once up front, to answer a nesting too deep with 400
BRACKETS_CHECKED = 1000

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def _reply(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error_code": code, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestLimits:
    """The ASGI layer of the module's docstring around ``app`` (only ``POST /invocations`` is checked)."""

    def __init__(self, app: Any, max_bytes: int = MAX_REQUEST_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("path") != "/invocations":
            return await self.app(scope, receive, send)
        too_big = (f"the request body is over {self.max_bytes:,} bytes (CAPFLOW_MAX_REQUEST_BYTES): send fewer "
                   "or smaller images per request")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _reply(send, 413, "RESOURCE_LIMIT_EXCEEDED", too_big)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await _reply(send, 413, "RESOURCE_LIMIT_EXCEEDED", too_big)
            if not message.get("more_body", False):
                break
        if body.count(b"[") + body.count(b"{") > BRACKETS_CHECKED:
            try:
                json.loads(body)
            except RecursionError:
                return await _reply(send, 400, "INVALID_PARAMETER_VALUE",
                                    "the request's JSON is nested too deeply (thousands of levels of [ or {)")
            except ValueError:
                pass  # not JSON (or not valid): MLflow's parser says what is wrong
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)


def _build() -> Any:
    from mlflow.pyfunc import scoring_server

    model = scoring_server.load_model_with_mlflow_config(os.environ[scoring_server._SERVER_MODEL_PATH])
    return RequestLimits(scoring_server.init(model),
                         max_bytes=int(os.environ.get("CAPFLOW_MAX_REQUEST_BYTES", MAX_REQUEST_BYTES)))


def __getattr__(name: str) -> Any:  # ``uvicorn tasks.serving_app:app``: the model loads when the app is asked for
    if name == "app":
        globals()["app"] = built = _build()
        return built
    raise AttributeError(name)
