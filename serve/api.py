"""The HTTP side of the Serve app: the FastAPI router, OpenAI-style error bodies for every failure, request counting,
and the bounded body read. serve/app.py binds ChatServer's routes to `api`."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.engine import RequestRejectedError
from serve.metrics import serve_metrics
from serve.protocol import APIError

log = logging.getLogger("medray.serve")

ROUTES = ("/health", "/v1/models", "/v1/chat/completions")

api = FastAPI(title="medray", docs_url=None, redoc_url=None, openapi_url=None)


def error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


@api.exception_handler(APIError)
async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error_response(error)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    message = "no such route" if error.status_code == 404 else str(error.detail)
    return error_response(APIError(error.status_code, message))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(APIError(400, f"invalid request: {error.errors()[:3]}"))


@api.exception_handler(RequestRejectedError)
async def _rejected(request: Request, error: RequestRejectedError) -> JSONResponse:
    return error_response(APIError(400, f"the engine refused the request: {error}"))


@api.exception_handler(Exception)
async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path)
    return error_response(APIError(500, f"internal error ({type(error).__name__}); the server is still up"))


class CountRequests:
    """Counts responses by route and status. A plain ASGI middleware: Starlette's `@app.middleware` re-wraps every
    response in memory streams, a cost per request that shows when the replica shares its cores with the engine."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                serve_metrics().request(route, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            serve_metrics().request(route, 500)
            raise


api.add_middleware(CountRequests)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it (or its declared length) passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    return bytes(body)
