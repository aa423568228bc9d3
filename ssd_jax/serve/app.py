"""The HTTP face: FastAPI routes in OpenAI's request and response formats, over the serving engine.

Request bodies are validated by :mod:`ssd_jax.serve.protocol`, answered by :mod:`ssd_jax.serve.respond`
(streaming uses server-sent events from ``sse_starlette``: OpenAI's chunk objects, then ``[DONE]``).
With an API key (``--api-key`` or ``SSD_JAX_API_KEY``), the ``/v1`` routes answer 401 unless the
request carries ``Authorization: Bearer KEY`` (compared in constant time); ``/health`` and ``/metrics``
stay open.
"""

from __future__ import annotations

import contextlib
import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ssd_jax.decoding.batch import encode_prompts
from ssd_jax.errors import UserError
from ssd_jax.serve.engine import ServingEngine, fresh_seed
from ssd_jax.serve.protocol import ChatRequest, CompletionRequest, sampling_of
from ssd_jax.serve.respond import Reply, Server, error

__all__ = ["build_app", "error"]


def build_app(engine: ServingEngine, served_name: str, metrics, api_key: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()  # after uvicorn's graceful wait: whatever still runs is cancelled

    app = FastAPI(title="ssd_jax", docs_url=None, redoc_url=None, lifespan=lifespan)
    srv = Server(engine, metrics, served_name, engine.model.tokenizer)
    _add_errors_and_auth(app, api_key)
    _add_info_routes(app, srv)
    _add_generation_routes(app, srv)
    return app


def _add_errors_and_auth(app: FastAPI, api_key: str | None) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        return error(400, f"{loc}: {msg}" if loc else msg, param=loc or None)

    if api_key is None:
        return
    want = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if request.url.path.startswith("/v1"):
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):
                msg = "invalid or missing API key: send 'Authorization: Bearer <key>'"
                return error(401, msg, code="invalid_api_key")
        return await call_next(request)


def _add_info_routes(app: FastAPI, srv: Server) -> None:
    engine = srv.engine

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": engine.error}, 503)
        return {"status": "ok", "running": engine.running, "waiting": len(engine.waiting)}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": srv.name,
            "object": "model",
            "created": 0,
            "owned_by": "ssd_jax",
            "max_model_len": engine.max_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_generation_routes(app: FastAPI, srv: Server) -> None:
    engine, model = srv.engine, srv.engine.model

    async def run(request: Request, req, prompts_ids: list[list[int]], chat: bool):
        try:
            plans = []
            for ids in prompts_ids:
                room = engine.max_len - engine.extra_slots
                sp = sampling_of(req, len(ids), served_name=srv.name, room=room, seed=fresh_seed())
                engine.check_fits(len(ids), sp.max_new_tokens)
                # sample i of a seeded request: its own stream, fixed by (seed, i)
                plans += [(ids, sp, i) for i in range(req.n)]
        except UserError as e:
            return error(400, str(e))
        n_prompt = sum(len(ids) for ids in prompts_ids)
        return await Reply(srv, request, req, plans, chat, n_prompt).respond()

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        p = req.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            return error(400, "prompt: empty", param="prompt")
        try:
            ids = encode_prompts(model, prompts, chat=False)
        except UserError as e:
            return error(400, str(e), param="prompt")
        return await run(request, req, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest):
        if model.tokenizer is None:
            return error(400, f"model {srv.name} has no tokenizer: chat needs one")
        try:
            messages = req.chat_messages()
        except UserError as e:
            return error(400, str(e), param="messages")
        try:
            text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            return error(400, f"chat template: {e}", param="messages")
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        return await run(request, req, [ids], chat=True)
