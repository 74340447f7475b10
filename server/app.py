"""The FastAPI application: factory, lifespan (the engine: a thread here, or the engine core process), operational
routes."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .api.chat.router import router as chat_router
from .api.common.dependencies import require_key
from .api.common.errors import APIError, RequestBody, ServerErrors, error_response, install_handlers
from .api.common.limits import RequestLimits
from .api.common.logprob_budget import LogprobBudget
from .api.common.metrics import CONTENT_TYPE_LATEST, Metrics
from .api.common.openapi import OPERATIONAL_RESPONSES, document_errors
from .api.common.streaming import BODY_SEND
from .api.completions.router import router as completions_router
from .api.models.router import router as models_router
from .api.responses.router import router as responses_router
from .api.sessions.idempotency import KeyedResults
from .api.sessions.router import router as sessions_router
from .api.web.router import router as web_router
from .engine import heap
from .engine_process.remote import connect_core, spawn_core
from .settings import Settings
from .version import package_version

logger = logging.getLogger(__name__)
access_log = logging.getLogger("linserve.access")


@asynccontextmanager
async def lifespan(app: FastAPI):
    state = app.state
    loop = asyncio.get_running_loop()  # (reads and writes the engine core's connection: engine_process/loop_link.py)
    # loading on every CPU, in a thread that ends with it: the engine's OpenMP team stays the only one
    # (engine/cpu_threads.py)
    if state.core_link is not None:  # one of `api_servers` > 1 frontends (serve.py spawned the core and us)
        conn, process = state.core_link
        state.engine, state.tokenizer, state.generation = await asyncio.to_thread(  # every frontend's requests,
            connect_core, state.settings, conn, process, state.metrics.observe, state.metrics.counted,  # counted
            loop)
        state.metrics.count_request = state.engine.count_request
        state.metrics.describe_processes(os.getppid())
    elif state.settings.engine_placement():  # the engine core in a process of its own: `serve` started it, or here
        conn, process = state.core_started or await asyncio.to_thread(spawn_core, state.settings)
        state.engine, state.tokenizer, state.generation = await asyncio.to_thread(
            connect_core, state.settings, conn, process, state.metrics.observe, loop=loop)
        state.metrics.describe_processes(os.getpid())  # (process_*: this process and the core, summed)
    else:  # the engine in this process (only then is torch imported here)
        from .engine.cpu_threads import in_passing_thread
        from .loading import load_engine

        state.engine, state.tokenizer, state.generation = await asyncio.to_thread(
            in_passing_thread, load_engine, state.settings, state.metrics.observe)
    facts = state.engine.facts
    state.metrics.set_pool(facts.slot_bytes, facts.pool_bytes)
    if facts.decode_step:
        state.metrics.watch_decode_step(state.engine.describe_decode_step)
    state.limits = RequestLimits.of(state.settings, state.tokenizer, state.generation)  # what a request may ask
    state.engine.on_death.append(lambda error: loop.call_soon_threadsafe(engine_died, app))
    heap.freeze_startup_objects("frontend")  # (engine/heap.py: no 150 ms collection stops the event loop later)
    state.ready = True
    try:
        yield
    finally:
        await drain(app)
        heap.unfreeze()  # (an app started again in this process: what this one froze may be freed)


def engine_status(engine) -> dict:
    """What /ready says of the engine beside its device (asked of the engine core when it is another process)."""
    return {"decode_step": engine.describe_decode_step(), "speculation": engine.describe_speculation(),
            "session_store": engine.store_status()}


def engine_died(app: FastAPI) -> None:
    """/health and /ready already answer 503 (they ask the engine); stop the process so a supervisor
    restarts it: `serve` exits non-zero after uvicorn has drained."""
    state = app.state
    state.ready = False
    logger.critical("the engine is dead: /health and /ready answer 503; shutting down for a restart")
    if state.request_exit is not None:
        state.request_exit()


def engine_alive(app: FastAPI) -> bool:
    engine = getattr(app.state, "engine", None)
    return engine is None or engine.alive


async def drain(app: FastAPI) -> None:
    """Stop taking work (/ready → 503), end running streams with finish reason `abort`, stop the engine."""
    state = app.state
    state.ready, state.draining = False, True
    if getattr(state, "engine", None) is not None:
        await asyncio.to_thread(state.engine.stop)


class RequestMetrics:
    """The outermost middleware: gives every HTTP request an id (the client's `X-Request-Id` if it sent a
    sane one), returns it in `X-Request-Id`, counts the request by route template and status (no
    per-session labels) and writes one access-log line — method, path, status, duration, id; never the
    query string, the API key or the prompt."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = client_request_id(scope) or f"req-{uuid.uuid4().hex[:16]}"
        scope.setdefault("state", {})["request_id"] = request_id
        status: dict = {"code": 500}
        started = time.perf_counter()

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = list(message.get("headers", []))
                own = [value for name, value in headers if name.lower() == b"x-request-id"]
                if own:  # an engine error names its generation's id: the log line follows it
                    status["id"] = own[0].decode("latin-1")
                else:
                    message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.count_request(endpoint, str(status["code"]))
            client = scope.get("client")
            access_log.info('%s "%s %s" %d %.1f ms %s', f"{client[0]}:{client[1]}" if client else "-",
                            log_safe(scope.get("method", "")), log_safe(scope.get("path", "")), status["code"],
                            1e3 * (time.perf_counter() - started), log_safe(status.get("id", request_id)))


def log_safe(text: str) -> str:
    """A client-controlled value as it may appear in a log line: control characters, non-ASCII, quotes and
    backslashes escaped (`\\n`, `\\x1b`, `\\"`), so one request is always one line that says what was sent."""
    return text.encode("unicode_escape").decode("ascii").replace('"', '\\"')


def client_request_id(scope: Scope) -> str | None:
    """A client's own X-Request-Id, kept if it is short printable ASCII (it goes into logs and headers)."""
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= 128 and all(33 <= ord(c) < 127 for c in text):
                return text
    return None


DOCS_ASSETS = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8", "swagger-ui.css": "text/css; charset=utf-8",
               "redoc.standalone.js": "text/javascript; charset=utf-8"}


def add_docs(app: FastAPI, settings: Settings) -> None:
    """/openapi.json, /docs and /redoc: behind the API key when keys are set, unless `docs_public`. Swagger UI's
    and ReDoc's files come from the installed `fastapi-offline` package, never a CDN: the pages work on an
    offline machine."""
    import fastapi_offline

    guard = [] if settings.docs_public else [Depends(require_key)]
    static = Path(fastapi_offline.__file__).parent / "static"
    assets = {name: (static / name).read_bytes() for name in DOCS_ASSETS}

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def swagger_asset(name: str) -> Response:
        if name not in assets:
            raise APIError(404, f"no such file: {name[:64]!r}", "name", code="not_found")
        return Response(assets[name], media_type=DOCS_ASSETS[name], headers={"Cache-Control": "max-age=86400"})

    @app.get("/openapi.json", include_in_schema=False, dependencies=guard)
    async def openapi_document() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guard)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="linserve API",
                                   swagger_js_url="/docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/assets/swagger-ui.css", swagger_favicon_url="/favicon.ico")

    @app.get("/redoc", include_in_schema=False, dependencies=guard)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="linserve API",
                              redoc_js_url="/docs/assets/redoc.standalone.js", redoc_favicon_url="/favicon.ico",
                              with_google_fonts=False)


class LinserveAPI(FastAPI):
    """The app; it hands the server's own `send` to responses that stream (streaming.BODY_SEND: their body chunks
    skip the middlewares' send wrappers, which only look at a response's start)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[BODY_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.load()
    app = LinserveAPI(title="linserve", version=package_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, description="Causal linear-attention LM server: constant per-token latency "
                  "and state size.")
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.ready = False
    app.state.draining = False
    app.state.request_exit = None  # set by `serve`: how a dead engine stops the process
    app.state.core_link = None  # set by `serve` in each of `api_servers` > 1 frontends: (connection, CoreProcess)
    app.state.core_started = None  # set by `serve` with `api_servers` 1: (connection, the core's Process)
    app.state.started = int(time.time())
    app.state.recent_results = KeyedResults()
    app.state.logprob_budget = LogprobBudget(int(settings.logprobs_memory_mb * 2**20), settings.retry_after_s)
    install_handlers(app)
    for router in (models_router, completions_router, chat_router, responses_router, sessions_router):
        app.include_router(router)
    if settings.web_ui:
        app.include_router(web_router)

    @app.get("/health", responses=OPERATIONAL_RESPONSES)
    async def health(request: Request) -> Response:
        """Liveness: 200 while the engine thread runs; 503 once it has died (the process then exits)."""
        if not engine_alive(request.app):
            return error_response(503, "the engine has died", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/ready", responses=OPERATIONAL_RESPONSES)
    async def ready(request: Request) -> Response:
        """Readiness: 200 once the model is loaded (eager serves while the decode step compiles; the body says
        how far compiling is); 503 while loading, draining or after an engine failure."""
        if not request.app.state.ready or not engine_alive(request.app):
            return error_response(503, "not ready: loading, draining or failed", code="not_ready",
                                  headers={"Retry-After": str(settings.retry_after_s)})
        # stateless work needs no store: ready stays 200 while it is down, and says so
        engine = request.app.state.engine
        return JSONResponse({"status": "ready", "model": settings.served_model_name, "device": engine.facts.device,
                             **await asyncio.to_thread(engine_status, engine)})

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics(request: Request) -> Response:
        engine = getattr(request.app.state, "engine", None)
        if request.app.state.core_link is not None and engine is not None:
            await asyncio.to_thread(engine.sync)  # the requests other frontends counted reach us through the core
        # (off the loop: the decode step's status is a question to the engine core, whose answer the loop reads)
        return Response(await asyncio.to_thread(request.app.state.metrics.render), media_type=CONTENT_TYPE_LATEST)

    add_docs(app, settings)
    document_errors(app)
    app.add_middleware(RequestBody, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(ServerErrors)
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    return app
