"""build_app: the OpenAI-compatible ASGI application (starlette routes, pure ASGI middleware).

Runs in: the ApiServer process.

Layers, outermost first: request id and access log -> response counter -> CORS (only with --allowed-origins) -> API-key auth
(deny by default; public: /health, /ready and /) -> body limit (413 before reading) -> starlette routes.
Every error a client can see uses OpenAI's envelope, including 404 and 405 from the router.
"""

from __future__ import annotations

import logging
import pathlib
import time
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

if TYPE_CHECKING:  # imported only with --otlp-traces-endpoint (no cost without)
    from vx.http.tracing import RequestTracer

import vx
from vx import envs
from vx.errors import EngineDeadError
from vx.http import chat, completions
from vx.http.access_log import AccessLogMiddleware
from vx.http.dashboard import EngineEvents, StatsLogger, UIMiddleware, make_lifespan
from vx.http.engine_client import EngineClient
from vx.http.errors import APIError, error_response
from vx.http.generation import ServerContext
from vx.http.grammars import GrammarChecker
from vx.http.metrics import CONTENT_TYPE, Metrics
from vx.http.middleware import (
    AuthMiddleware,
    BodyLimitMiddleware,
    BodyTooLargeError,
    ResponseCounterMiddleware,
    chain,
)
from vx.http.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from vx.http.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

INFERENCE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_ENCODER = msgspec.json.Encoder()


def _json(body: Any, status: int = 200) -> Response:
    return Response(_ENCODER.encode(body), status_code=status, media_type="application/json")


class Endpoints:
    """The route handlers, bound to one ServerContext."""

    def __init__(self, ctx: ServerContext, started: float) -> None:
        self.ctx = ctx
        self.started = started

    async def completions(self, request: Request) -> Response:
        return await completions.create_completion(self.ctx, request)

    async def chat_completions(self, request: Request) -> Response:
        return await chat.create_chat_completion(self.ctx, request)

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "vx",
            "root": name,
            "parent": None,
            "max_model_len": self.ctx.max_model_len,
        }

    async def models(self, request: Request) -> Response:
        return _json(
            {"object": "list", "data": [self._model_card(n) for n in self.ctx.served_model_names]}
        )

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        self.ctx.check_model(name)
        return _json(self._model_card(name))

    async def health(self, request: Request) -> Response:
        """Liveness: 200 while the engine tree is alive (loading and draining included)."""
        if self.ctx.client.is_dead:
            return error_response(
                503, "The engine is dead; retry on another replica.", code="engine_dead"
            )
        return _json({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Readiness: 200 only while a request would be served; 503 while loading, draining
        (from the first SIGTERM) or dead."""
        try:
            self.ctx.check_available()
        except APIError as e:
            return e.response()
        return _json({"status": "ready"})

    async def load(self, request: Request) -> Response:
        """The queue depth for a router, in one cheap call: no engine round trip (the figures
        are the engines' last step reports) and no Prometheus text."""
        client = self.ctx.client
        engines = []
        for i in range(client.num_engines):
            stats = client.latest_stats(i)
            engines.append(
                {
                    "index": i,
                    "running": stats.num_running if stats else 0,
                    "waiting": stats.num_waiting if stats else 0,
                    "kv_cache_usage": stats.kv_usage if stats else 0.0,
                }
            )
        return _json(
            {
                "in_flight": client.num_unfinished,
                "running": sum(e["running"] for e in engines),
                "waiting": sum(e["waiting"] for e in engines),
                "ready": client.is_ready and not client.is_dead and not client.draining,
                "draining": client.draining,
                "engines": engines,
            }
        )

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Development endpoint (served only with `VX_SERVER_DEV_MODE=1`, as vLLM's is with
        `VLLM_SERVER_DEV_MODE`): every engine forgets its cached prefixes, and each one that
        has a KV-event publisher announces AllBlocksCleared. An engine resets only while no
        request holds blocks: vx does not preempt running requests for it, so
        `reset_running_requests=true` is refused (400), and a busy engine answers 409."""
        if request.query_params.get("reset_running_requests", "false").lower() == "true":
            return error_response(
                400, "vx resets the prefix cache only while idle (reset_running_requests "
                "is not supported)", code="unsupported",
            )  # fmt: skip
        client = self.ctx.client
        try:
            refused = [
                i for i in range(client.num_engines)
                if not (await client.call_utility("reset_prefix_cache", engine_index=i))["ok"]
            ]  # fmt: skip
        except EngineDeadError:
            return error_response(503, "The engine is dead.", code="engine_dead")
        if refused:
            return error_response(
                409, f"engine(s) {refused} hold blocks for running requests; retry when idle",
                code="busy",
            )  # fmt: skip
        logger.info("prefix cache reset on %d engine(s)", client.num_engines)
        return _json({"ok": True})

    async def version(self, request: Request) -> Response:
        ready = self.ctx.client.ready
        return _json(
            {
                "version": vx.__version__,
                "engine_pids": [r.engine_pid for r in ready],
                "worker_pids": [pid for r in ready for pid in r.worker_pids],
                "batch_invariant": all(r.batch_invariant for r in ready) if ready else False,
            }
        )

    async def tokenize(self, request: Request) -> Response:
        req = parse_body(await completions.read_body(request), TokenizeRequest)
        self.ctx.check_model(req.model)
        tok = self.ctx.tokenizer
        if req.messages is not None:
            text = chat.render_chat(
                tok,
                chat.message_dicts(req.messages),
                add_generation_prompt=req.add_generation_prompt,
            )
            ids = await tok.encode_async(text, add_special_tokens=False)
        elif req.prompt is not None:
            ids = await tok.encode_async(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "either prompt or messages is required", param="prompt")
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.ctx.max_model_len,
            "tokens": ids,
        }
        if req.return_token_strs:
            body["token_strs"] = [tok.id_to_token(i) for i in ids]
        return _json(body)

    async def detokenize(self, request: Request) -> Response:
        req = parse_body(await completions.read_body(request), DetokenizeRequest)
        self.ctx.check_model(req.model)
        tok = self.ctx.tokenizer
        bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of vocabulary", param="tokens")
        return _json({"prompt": tok.decode(req.tokens)})

    async def metrics(self, request: Request) -> Response:
        await self.ctx.metrics.refresh_self_check()
        return Response(self.ctx.metrics.render(), media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        return _json(openapi_document())

    async def root(self, request: Request) -> Response:
        return _json(
            {"name": "vx", "version": vx.__version__, "models": self.ctx.served_model_names}
        )


def openapi_document() -> dict[str, Any]:
    """A hand-built OpenAPI 3.1 document; request schemas come from the msgspec Structs."""
    from vx.http.protocol import ChatCompletionRequest, CompletionRequest

    (completion, chat_req, tok_req, detok_req), components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest],
        ref_template="#/components/schemas/{name}",
    )
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    json_ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}

    def errors(*statuses: int) -> dict[str, Any]:
        return {str(s): {"description": "error", **error} for s in statuses}

    def post(summary: str, schema: dict[str, Any], streams: bool) -> dict[str, Any]:
        ok = dict(json_ok)
        if streams:
            ok = {"description": "OK (JSON, or SSE when stream is true)", "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}},
            }}  # fmt: skip
        return {
            "post": {
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                },
                "responses": {"200": ok, **errors(400, 401, 404, 413, 503)},
            }
        }

    def get(summary: str, media: str = "application/json", *statuses: int) -> dict[str, Any]:
        ok = {
            "description": "OK",
            "content": {
                media: {"schema": {"type": "object" if media.endswith("json") else "string"}}
            },
        }
        return {"get": {"summary": summary, "responses": {"200": ok, **errors(401, *statuses)}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "vx", "version": vx.__version__},
        "paths": {
            "/v1/completions": post("Create a completion", completion, True),
            "/v1/chat/completions": post("Create a chat completion", chat_req, True),
            "/tokenize": post("Tokenize a prompt or messages", tok_req, False),
            "/detokenize": post("Detokenize token ids", detok_req, False),
            "/v1/models": get("List models"),
            "/v1/models/{model}": {
                "get": {
                    "summary": "Retrieve a model",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {"200": json_ok, **errors(401, 404)},
                }
            },
            "/health": get(
                "Liveness: 200 while the engine tree is alive, 503 once it died",
                "application/json", 503,
            ),
            "/ready": get(
                "Readiness: 200 while requests are served; 503 loading, draining or dead",
                "application/json", 503,
            ),
            "/load": get("Queue depth: requests in flight, running and waiting per engine"),
            "/version": get("Server version"),
            "/metrics": get("Prometheus metrics", "text/plain"),
            "/openapi.json": get("This document"),
            "/v1/engine/events": get("Dashboard feed: engine snapshots", "text/event-stream"),
        },
        "components": {"schemas": components},
    }


def _error_handlers() -> dict[Any, Any]:
    async def http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        messages = {404: f"Route {request.url.path} not found.", 405: "Method not allowed."}
        return error_response(
            exc.status_code,
            messages.get(exc.status_code, str(exc.detail)),
            headers=dict(exc.headers or {}),
        )

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def too_large(request: Request, exc: Exception) -> Response:
        return error_response(413, "The request body is too large.", code="request_too_large")

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(500, "Internal server error.", code="internal_error")

    return {
        HTTPException: http_exception,
        APIError: api_error,
        BodyTooLargeError: too_large,
        Exception: server_error,
    }


#: The chat templates vx ships (`--chat-template NAME`): `chatml_tools`, ChatML with tools.
TEMPLATES = pathlib.Path(__file__).parent / "templates"


def read_chat_template(name_or_path: str) -> str:
    """`--chat-template`'s text: a file, or the name of a template in `TEMPLATES`."""
    path = pathlib.Path(name_or_path)
    if not path.is_file():
        path = TEMPLATES / f"{name_or_path}.jinja"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
        raise ValueError(f"--chat-template {name_or_path!r}: no such file, nor one of {shipped}")
    return path.read_text()


def build_app(
    engine_client: EngineClient,
    *,
    served_model_name: str | list[str],
    tokenizer_path: str | None = None,
    tokenizer: Tokenizer | None = None,
    api_keys: list[str] | None = None,
    allowed_origins: list[str] | None = None,
    max_body_bytes: int = 32 * 1024 * 1024,
    keepalive_s: float = 15.0,
    stall_timeout_s: float = 60.0,
    access_log: bool = True,
    tracer: RequestTracer | None = None,
    structured_outputs_timeout_s: float = 5.0,
    tool_call_parser: str = "hermes",
    reasoning_parser: str | None = None,
    chat_template: str | None = None,
) -> ASGIApp:
    """The ASGI app serving `engine_client`'s model under `served_model_name`.

    Args:
        engine_client: a running EngineClient (its EngineReady gives max_model_len).
        served_model_name: the name (or names) clients must use; the first is reported.
        tokenizer_path: the HF model directory to load the tokenizer from (or pass `tokenizer`).
        api_keys: accepted keys; empty means no auth.
        allowed_origins: CORS origins ("*" for any); empty means no CORS headers.
        max_body_bytes: larger request bodies get 413.
        access_log: write one access line per request (ids are echoed either way).
        tracer: one OpenTelemetry span per generation request (None: no tracing).
        structured_outputs_timeout_s: a new grammar's compile limit (then a 400).
        tool_call_parser: how `tool_choice: auto` finds calls (`vx.http.tool_calls`).
        reasoning_parser: how reasoning is split from content (`vx.http.reasoning`), or None.
        chat_template: a Jinja file replacing the tokenizer's chat template.
    """
    if tokenizer is None:
        if tokenizer_path is None:
            raise ValueError("build_app needs tokenizer_path or tokenizer")
        tokenizer = load_tokenizer(tokenizer_path)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(names):
        raise ValueError("served_model_name must be a non-empty name")
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    metrics = Metrics(engine_client, names[0])
    engine_client.observer = metrics
    ctx = ServerContext(
        client=engine_client,
        tokenizer=tokenizer,
        served_model_names=names,
        metrics=metrics,
        keepalive_s=keepalive_s,
        stall_timeout_s=stall_timeout_s,
        tracer=tracer,
        grammars=GrammarChecker(tokenizer, metrics, structured_outputs_timeout_s).prepare(),
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    ep = Endpoints(ctx, time.time())
    events = EngineEvents(engine_client, metrics, model_name=names[0])
    routes = [
        Route("/v1/completions", ep.completions, methods=["POST"]),
        Route("/v1/chat/completions", ep.chat_completions, methods=["POST"]),
        Route("/v1/models", ep.models, methods=["GET"]),
        Route("/v1/models/{model:path}", ep.model, methods=["GET"]),
        Route("/health", ep.health, methods=["GET"]),
        Route("/ready", ep.ready, methods=["GET"]),
        Route("/load", ep.load, methods=["GET"]),
        Route("/version", ep.version, methods=["GET"]),
        Route("/tokenize", ep.tokenize, methods=["POST"]),
        Route("/detokenize", ep.detokenize, methods=["POST"]),
        Route("/metrics", ep.metrics, methods=["GET"]),
        Route("/openapi.json", ep.openapi, methods=["GET"]),
        Route("/v1/engine/events", events.stream, methods=["GET"]),
        Route("/", ep.root, methods=["GET"]),
    ]
    if envs.VX_SERVER_DEV_MODE:
        logger.warning("VX_SERVER_DEV_MODE: development endpoints are served (not for production)")
        routes.append(Route("/reset_prefix_cache", ep.reset_prefix_cache, methods=["POST"]))
    # The lifespan runs the dashboard's block-map poller and the periodic progress line.
    lifespan = make_lifespan(events.poll_block_maps, StatsLogger(engine_client, metrics).run)
    app = Starlette(routes=routes, exception_handlers=_error_handlers(), lifespan=lifespan)
    app.state.vx = ctx

    def on_reject(path: str, status: int) -> None:
        if path in INFERENCE_PATHS:
            metrics.received.inc()
            metrics.rejected(status)

    layers: list[tuple[Any, dict[str, Any]]] = [
        (AccessLogMiddleware, {"enabled": access_log}),
        (
            ResponseCounterMiddleware,
            {"record": metrics.http_response, "paths": {r.path for r in routes}},
        ),
    ]
    if allowed_origins:
        layers.append(
            (
                CORSMiddleware,
                {
                    "allow_origins": list(allowed_origins),
                    "allow_methods": ["GET", "POST", "OPTIONS"],
                    "allow_headers": ["authorization", "content-type", "x-api-key"],
                    "max_age": 600,
                },
            )
        )
    # The static pages (chat, dashboard) are public; their API calls carry the key.
    layers.append((UIMiddleware, {}))
    if api_keys:
        layers.append((AuthMiddleware, {"api_keys": api_keys, "on_reject": on_reject}))
    layers.append((BodyLimitMiddleware, {"max_body_bytes": max_body_bytes, "on_reject": on_reject}))
    wrapped = chain(app, *layers)
    wrapped.state = app.state  # type: ignore[attr-defined]
    return wrapped
