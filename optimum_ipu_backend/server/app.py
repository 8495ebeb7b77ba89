"""The ASGI app (Starlette) of ``optimum-ipu serve``: endpoints, errors, loading and draining.

Requests run the model in worker threads (one per request in flight, bounded by
``max_concurrent_requests``), so concurrent requests meet in the session's dynamic batcher and share
device steps. Errors are JSON in the convention of the endpoint's family: text-embeddings-inference's
``{"error", "error_type"}`` (plus ``field``) for ``/embed`` and ``/predict``, OpenAI's
``{"error": {"message", "type", "param", "code"}}`` under ``/v1/``. A refused request is a 4xx naming the
field and the limit; a failure inside the engine is a 500 for that request alone.

The model loads in a thread after the socket is open: ``/health`` answers 503 until it is loaded (and,
with ``precompile``, compiled), then 200. A failed load is logged and stops the server (``load_error``).
On shutdown uvicorn stops accepting, lets the requests in flight finish (its graceful-shutdown timeout),
and only then is the model closed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from optimum_ipu_backend.errors import InvalidFeedError
from optimum_ipu_backend.server.metrics import ServerMetrics
from optimum_ipu_backend.server.models import RequestError, ServedModel
from optimum_ipu_backend.server.schemas import (
    CompletionRequest,
    EmbeddingsRequest,
    EmbedRequest,
    PredictRequest,
)

_logger = logging.getLogger(__name__)

#: text-embeddings-inference's default ``--max-concurrent-requests``; beyond it a request gets a 429.
DEFAULT_MAX_CONCURRENT_REQUESTS = 512
ENCODER_TASKS = ("feature-extraction", "text-classification")
#: endpoint -> the tasks that serve it
ENDPOINT_TASKS = {
    "/embed": ("feature-extraction",),
    "/v1/embeddings": ("feature-extraction",),
    "/predict": ("text-classification",),
    "/v1/completions": ("text-generation",),
}


class _Refused(Exception):
    """A request answered with an error status before (or instead of) running the model."""

    def __init__(self, status: int, message: str, field: str | None = None, kind: str = "validation") -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.kind = status, message, field, kind


def _field_name(location: tuple[Any, ...]) -> str:
    """pydantic's error location as a path: ``("inputs", 3)`` -> ``inputs[3]``; union branch names (the
    type tried, such as ``str`` or ``list[str]``) are dropped."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif (
            "[" in part
            or part in {"str", "int", "float", "bool", "list", "literal"}
            or part.startswith(("constrained-", "function-"))
        ):
            continue
        else:
            path += f".{part}" if path else part
    return path or "body"


def _validation_message(error: ValidationError) -> tuple[str, str]:
    """A pydantic error as (field, message): the most specific problem (the deepest field; of a union,
    what each accepted form says), and which other fields have problems."""
    problems = [(_field_name(tuple(p["loc"])), p) for p in error.errors(include_url=False)]
    depth = max(len(tuple(p["loc"])) for _, p in problems)
    deepest = [(f, p) for f, p in problems if len(tuple(p["loc"])) == depth]
    field = deepest[0][0]
    if deepest[0][1]["type"] == "extra_forbidden":
        return field, f"{field}: unknown field, not supported by this server"
    messages = "; or ".join(dict.fromkeys(p["msg"] for f, p in deepest if f == field))
    if deepest[0][1]["type"] == "missing":
        message = f"{field}: {messages}"
    else:
        message = f"{field}: {messages} (got {deepest[0][1].get('input')!r:.80})"
    others = {f for f, _ in problems} - {field} - {field.split("[")[0]}
    if others:
        message += f"; also: {', '.join(sorted(others))}"
    return field, message


async def _parse(request: Request, schema: type[BaseModel]) -> Any:
    body = await request.body()
    if not body:
        raise _Refused(400, "the request has no body; send a JSON object", "body")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Refused(400, f"the request body is not valid JSON: {exc}", "body") from None
    if not isinstance(data, dict):
        raise _Refused(422, f"the request body must be a JSON object, not {type(data).__name__}", "body")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        field, message = _validation_message(exc)
        raise _Refused(422, message, field) from None


def _error_body(path: str, refused: _Refused) -> dict[str, Any]:
    if path.startswith("/v1/"):
        kind = "invalid_request_error" if refused.status < 500 else "server_error"
        body: dict[str, Any] = {
            "error": {
                "message": refused.message,
                "type": kind,
                "param": refused.field,
                "code": refused.status,
            }
        }
    else:
        body = {"error": refused.message, "error_type": refused.kind, "field": refused.field}
    return body


def _error_response(path: str, refused: _Refused) -> JSONResponse:
    return JSONResponse(_error_body(path, refused), status_code=refused.status)


class ServerState:
    """What the endpoints share: the model once loaded, the metrics, the bound on requests in flight."""

    def __init__(self, load: Callable[[], ServedModel], max_concurrent_requests: int) -> None:
        self.load = load
        self.served: ServedModel | None = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0
        self.limiter = anyio.CapacityLimiter(max_concurrent_requests)
        self.metrics = ServerMetrics(lambda: self.served.sessions() if self.served is not None else [])
        self.on_load_failure: Callable[[], None] | None = None

    def load_in_background(self) -> threading.Thread:
        def run() -> None:
            try:
                self.served = self.load()
                _logger.info("model loaded: %s", json.dumps(self.served.info(), default=str)[:2000])
            except BaseException as exc:  # noqa: BLE001 - reported, and the server stops
                self.load_error = exc
                _logger.exception("optimum-ipu serve: the model failed to load; stopping")
                if self.on_load_failure is not None:
                    self.on_load_failure()
            finally:
                self.loaded.set()

        thread = threading.Thread(target=run, name="optimum-ipu-serve-load", daemon=True)
        thread.start()
        return thread

    def model_for(self, path: str) -> ServedModel:
        served = self.served
        if served is None:
            raise _Refused(
                503, "the model is still loading; retry when /health answers 200", None, "unhealthy"
            )
        tasks = ENDPOINT_TASKS[path]
        if served.task not in tasks:
            offered = [endpoint for endpoint, t in ENDPOINT_TASKS.items() if served.task in t]
            raise _Refused(
                404,
                f"{path} serves {' or '.join(tasks)} models; this server serves a {served.task} model "
                f"at {', '.join(offered)}",
                None,
                "not_found",
            )
        return served

    async def run_model(self, function: Callable[[], Any]) -> Any:
        """``function`` (a model call) in a worker thread; its errors as statuses."""
        try:
            return await anyio.to_thread.run_sync(function, limiter=self.limiter)
        except RequestError as exc:
            raise _Refused(exc.status, str(exc), exc.field) from None
        except InvalidFeedError as exc:
            raise _Refused(422, f"the model refused the input: {exc}", None) from None
        except Exception as exc:
            _logger.exception("engine fault while serving a request")
            raise _Refused(500, f"engine fault: {type(exc).__name__}: {exc}", None, "backend") from None


Handler = Callable[[Request, ServerState], Awaitable[Response]]


def _endpoint(state: ServerState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """A handler with the request metrics, the bound on requests in flight and the error bodies."""

    async def endpoint(request: Request) -> Response:
        path = request.url.path
        started = time.perf_counter()
        metrics = state.metrics
        if state.in_flight >= state.max_concurrent_requests:
            response: Response = _error_response(
                path,
                _Refused(
                    429,
                    f"{state.in_flight} requests are in flight, the limit (--max-concurrent-requests) is "
                    f"{state.max_concurrent_requests}; retry later",
                    None,
                    "overloaded",
                ),
            )
            metrics.errors.labels(path, "overloaded").inc()
            metrics.requests.labels(path, "429").inc()
            return response
        state.in_flight += 1
        metrics.in_flight.inc()
        streaming = False
        try:
            response = await handler(request, state)
            if isinstance(response, StreamingResponse):
                streaming = True
                response.body_iterator = _finish_after(response.body_iterator, state, path, started)
        except _Refused as refused:
            metrics.errors.labels(path, refused.kind).inc()
            response = _error_response(path, refused)
        finally:
            if not streaming:
                _finished(state, path, started)
        metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    return endpoint


def _finished(state: ServerState, path: str, started: float) -> None:
    state.in_flight -= 1
    state.metrics.in_flight.dec()
    state.metrics.latency.labels(path).observe(time.perf_counter() - started)


async def _finish_after(body: AsyncIterator[Any], state: ServerState, path: str, started: float):
    try:
        async for chunk in body:
            yield chunk
    finally:
        _finished(state, path, started)


# -- endpoints -------------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.serving
    if state.served is not None:
        return JSONResponse({"status": "ready"})
    status = "failed" if state.load_error is not None else "loading"
    return JSONResponse({"status": status}, status_code=503)


async def info(request: Request) -> Response:
    state: ServerState = request.app.state.serving
    if state.served is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    described = await anyio.to_thread.run_sync(state.served.info)
    # Which process answered: replicas behind one address (Ray Serve) are told apart by it.
    return JSONResponse({**described, "pid": os.getpid(), "host": socket.gethostname()})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.serving
    body = await anyio.to_thread.run_sync(generate_latest, state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _texts(inputs: str | list[str]) -> list[str]:
    return [inputs] if isinstance(inputs, str) else list(inputs)


def _check_count(served: ServedModel, count: int, field: str) -> None:
    if count > served.max_inputs:
        raise _Refused(
            413,
            f"{field}: {count} inputs, more than the {served.max_inputs} one request may carry "
            "(--max-inputs)",
            field,
        )


async def embed(request: Request, state: ServerState) -> Response:
    served = state.model_for("/embed")
    body = await _parse(request, EmbedRequest)
    texts = _texts(body.inputs)
    _check_count(served, len(texts), "inputs")

    def run() -> np.ndarray:
        rows = served.token_ids(texts, "inputs")
        state.metrics.count_real(len(rows), sum(map(len, rows)))
        return served.embed(rows, body.normalize)

    embeddings = await state.run_model(run)
    return JSONResponse(embeddings.tolist())


async def predict(request: Request, state: ServerState) -> Response:
    served = state.model_for("/predict")
    body = await _parse(request, PredictRequest)
    texts = _texts(body.inputs)
    _check_count(served, len(texts), "inputs")

    def run() -> list[list[dict[str, Any]]]:
        rows = served.token_ids(texts, "inputs")
        state.metrics.count_real(len(rows), sum(map(len, rows)))
        return served.classify(rows)

    scores = await state.run_model(run)
    return JSONResponse(scores[0] if isinstance(body.inputs, str) else scores)


async def embeddings(request: Request, state: ServerState) -> Response:
    served = state.model_for("/v1/embeddings")
    body = await _parse(request, EmbeddingsRequest)
    given = body.input
    if isinstance(given, str) or (isinstance(given, list) and isinstance(given[0], str)):
        texts, rows_given = _texts(given), None
    else:
        texts, rows_given = None, [given] if isinstance(given[0], int) else list(given)
    count = len(texts) if texts is not None else len(rows_given)
    _check_count(served, count, "input")

    def run() -> tuple[np.ndarray, int]:
        if texts is not None:
            rows = served.token_ids(texts, "input")
        else:
            served.check_token_ids(rows_given, "input")
            rows = rows_given
        tokens = sum(map(len, rows))
        state.metrics.count_real(len(rows), tokens)
        return served.embed(rows, normalize=True), tokens

    vectors, tokens = await state.run_model(run)
    if body.dimensions is not None and body.dimensions != vectors.shape[-1]:
        raise _Refused(
            422,
            f"dimensions={body.dimensions}: this model's embeddings have {vectors.shape[-1]} dimensions",
            "dimensions",
        )
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": (
                base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                if body.encoding_format == "base64"
                else vector.tolist()
            ),
        }
        for index, vector in enumerate(vectors)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def completions(request: Request, state: ServerState) -> Response:
    served = state.model_for("/v1/completions")
    body = await _parse(request, CompletionRequest)
    if isinstance(body.prompt, str):
        prompt = await state.run_model(lambda: served.token_ids([body.prompt], "prompt")[0])
    else:
        await state.run_model(lambda: served.check_token_ids([body.prompt], "prompt"))
        prompt = list(body.prompt)
    room = served.max_new_tokens(len(prompt))
    if body.max_tokens > room:
        raise _Refused(
            413,
            f"max_tokens={body.max_tokens}: the prompt's {len(prompt)} tokens leave room for {room} new "
            f"tokens in the model's {served.max_input_tokens}",
            "max_tokens",
        )
    state.metrics.count_real(1, len(prompt))
    ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    settings = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed}

    def choice(text: str, tokens: list[int], finish: str | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if body.return_token_ids:
            entry["token_ids"] = tokens
        return entry

    def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": ident,
            "object": "text_completion",
            "created": created,
            "model": served.name,
            "choices": choices,
        }

    if not body.stream:
        tokens, finish = await state.run_model(lambda: served.generate(prompt, body.max_tokens, **settings))
        state.metrics.generated_tokens.inc(len(tokens))
        state.metrics.count_real(0, len(tokens))
        result = envelope([choice(served.decode(tokens), tokens, finish)])
        result["usage"] = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt) + len(tokens),
        }
        return JSONResponse(result)
    return StreamingResponse(
        _stream(state, served, prompt, body.max_tokens, settings, choice, envelope),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _stream(state, served, prompt, max_tokens, settings, choice, envelope) -> AsyncIterator[str]:
    """Server-sent events: one chunk per generated token (its text delta), then the finish reason, then
    ``[DONE]``. A failure after the first byte (the status is sent) is an ``error`` event."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    def on_token(token: int) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, token)

    async def generate() -> tuple[list[int], str]:
        try:
            return await state.run_model(
                lambda: served.generate(prompt, max_tokens, on_token=on_token, **settings)
            )
        finally:
            queue.put_nowait(done)

    task = asyncio.ensure_future(generate())
    tokens: list[int] = []
    sent_text, sent_tokens = "", 0
    while (item := await queue.get()) is not done:
        tokens.append(item)
        text = served.decode(tokens)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the token that completes it
            continue
        chunk = choice(text[len(sent_text) :], tokens[sent_tokens:], None)
        sent_text, sent_tokens = text, len(tokens)
        yield f"data: {json.dumps(envelope([chunk]))}\n\n"
    try:
        _, finish = await task
    except _Refused as refused:
        yield f"data: {json.dumps(_error_body('/v1/', refused))}\n\n"
        return
    state.metrics.generated_tokens.inc(len(tokens))
    state.metrics.count_real(0, len(tokens))
    text = served.decode(tokens)
    yield f"data: {json.dumps(envelope([choice(text[len(sent_text) :], tokens[sent_tokens:], finish)]))}\n\n"
    yield "data: [DONE]\n\n"


def create_app(
    load: Callable[[], ServedModel],
    *,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    preload: bool = False,
) -> Starlette:
    """The app; ``load`` builds the served model, in a thread started when the app starts, or now with
    ``preload`` (a Ray Serve replica: it is healthy once constructed)."""
    state = ServerState(load, max_concurrent_requests)
    if preload:
        state.served = load()
        state.loaded.set()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not preload:
            state.load_in_background()
        try:
            yield
        finally:
            # uvicorn has drained the requests in flight; wait for a load still running, then close.
            await anyio.to_thread.run_sync(state.loaded.wait)
            if state.served is not None:
                state.served.close()
                _logger.info("model closed")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *(
            Route(path, _endpoint(state, handler), methods=["POST"])
            for path, handler in (
                ("/embed", embed),
                ("/predict", predict),
                ("/v1/embeddings", embeddings),
                ("/v1/completions", completions),
            )
        ),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.serving = state
    return app
