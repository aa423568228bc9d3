"""The HTTP face: FastAPI routes in OpenAI's request and response formats, over :class:`Engine`.

Streaming uses server-sent events from ``sse_starlette`` (OpenAI's chunk objects, then ``[DONE]``).
A request's sequences report from the engine thread into an ``asyncio.Queue`` on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse

from ssd_jax.decoding.batch import encode_prompts
from ssd_jax.errors import UserError
from ssd_jax.sampling.filters import SamplingParams
from ssd_jax.serve.engine import EngineDead, QueueFull, Sequence, ServingEngine, fresh_seed


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension; -1 also means off
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)


def error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def build_app(engine: ServingEngine, served_name: str, metrics) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()  # after uvicorn's graceful wait: whatever still runs is cancelled

    app = FastAPI(title="ssd_jax", docs_url=None, redoc_url=None, lifespan=lifespan)
    model = engine.model

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error(
            400,
            f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid"),
            param=loc or None,
        )

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": engine.error}, 503)
        return {"status": "ok", "running": engine.running, "waiting": len(engine.waiting)}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "ssd_jax",
                    "max_model_len": engine.max_len,
                }
            ],
        }

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def sampling_of(req: _Common, n_prompt: int) -> SamplingParams:
        if req.model is not None and req.model != served_name:
            raise UserError(f"model {req.model!r} is not served here (served: {served_name!r})")
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:  # chat: what the context leaves
            max_tokens = engine.max_len - engine.extra_slots - n_prompt
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise UserError("stop: at most 4 non-empty strings")
        if not 0.0 <= req.temperature <= 2.0:
            raise UserError(f"temperature must be in [0, 2], got {req.temperature}")
        sp = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=0 if req.top_k == -1 else req.top_k,
            seed=fresh_seed() if req.seed is None else req.seed,
            max_new_tokens=max_tokens,
            stop=tuple(stop),
            ignore_eos=req.ignore_eos,
        )
        sp.validate()
        engine.check_fits(n_prompt, max_tokens)
        return sp

    def plan(req: _Common, prompts_ids: list[list[int]]):
        """(sequences, their SamplingParams) for every prompt x n; raises UserError on bad parameters."""
        plans = []
        for ids in prompts_ids:
            sp = sampling_of(req, len(ids))
            for i in range(req.n):
                # sample i of a seeded request: its own stream, fixed by (seed, i)
                plans.append((ids, sp, i))
        return plans

    async def run(request: Request, req: _Common, prompts_ids: list[list[int]], chat: bool):
        try:
            plans = plan(req, prompts_ids)
        except UserError as e:
            return error(400, str(e))
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink_for(i):
            return lambda kind, x: loop.call_soon_threadsafe(q.put_nowait, (i, kind, x))

        seqs = [Sequence(ids, sp, sink_for(j), index=i) for j, (ids, sp, i) in enumerate(plans)]
        try:
            engine.submit(seqs)
        except QueueFull as e:
            return error(429, str(e), kind="rate_limit_error")
        except EngineDead as e:
            return error(503, str(e), kind="server_error")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        n_prompt = sum(len(ids) for ids in prompts_ids)
        obj = "chat.completion" if chat else "text_completion"

        def usage():
            gen = sum(len(s.row.tokens) if s.row is not None else 0 for s in seqs)
            return {"prompt_tokens": n_prompt, "completion_tokens": gen, "total_tokens": n_prompt + gen}

        def finished(reason_of):
            reasons = {reason_of(s) for s in seqs}
            metrics.request_done(n_prompt, "abort" if "cancelled" in reasons else sorted(reasons)[0])

        if not req.stream:
            remaining = len(seqs)
            try:
                while remaining:
                    try:
                        _, kind, _ = await asyncio.wait_for(q.get(), 0.5)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            engine.cancel(seqs)
                            metrics.request_done(n_prompt, "abort")
                            return Response(status_code=499)
                        continue
                    remaining -= kind == "done"
            except asyncio.CancelledError:
                engine.cancel(seqs)
                metrics.request_done(n_prompt, "abort")
                raise
            finished(lambda s: s.finish_reason)
            if any(s.finish_reason == "error" for s in seqs):
                return error(500, f"the engine failed: {engine.error}", kind="server_error")
            choices = []
            for i, s in enumerate(seqs):
                text = s.row.text if s.row is not None else ""
                c = {
                    "index": i,
                    "finish_reason": s.finish_reason,
                    "token_ids": list(s.row.tokens) if s.row else [],
                }
                if chat:
                    c["message"] = {"role": "assistant", "content": text}
                else:
                    c["text"], c["logprobs"] = text, None
                choices.append(c)
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": served_name,
                "choices": choices,
                "usage": usage(),
            }

        include_usage = bool((req.stream_options or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, **extra):
            return json.dumps(
                {
                    "id": rid,
                    "object": chunk_obj,
                    "created": created,
                    "model": served_name,
                    "choices": choices,
                    **extra,
                }
            )

        def piece(i, text=None, finish=None, first=False):
            if chat:
                delta = (
                    {"role": "assistant", "content": text or ""}
                    if first
                    else ({"content": text} if text else {})
                )
                return {"index": i, "delta": delta, "finish_reason": finish}
            return {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}

        async def events():
            remaining = len(seqs)
            try:
                if chat:
                    for i in range(len(seqs)):
                        yield chunk([piece(i, first=True)])
                while remaining:
                    i, kind, x = await q.get()
                    if kind == "text":
                        yield chunk([piece(i, x)])
                    elif x.finish_reason == "error":  # OpenAI streams an error object, then ends
                        remaining -= 1
                        yield json.dumps(
                            {
                                "error": {
                                    "message": f"the engine failed: {engine.error}",
                                    "type": "server_error",
                                    "param": None,
                                    "code": 500,
                                }
                            }
                        )
                        return
                    else:
                        remaining -= 1
                        yield chunk([piece(i, finish=x.finish_reason)])
                finished(lambda s: s.finish_reason)
                if include_usage:
                    yield chunk([], usage=usage())
                yield "[DONE]"
            finally:
                if remaining:  # the client went away (or the server stops): free the slots
                    engine.cancel(seqs)
                    metrics.request_done(n_prompt, "abort")

        return EventSourceResponse(events(), ping=None, sep="\n")

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
            return error(400, f"model {served_name} has no tokenizer: chat needs one")
        try:
            text = model.tokenizer.apply_chat_template(
                [m.model_dump() for m in req.messages], add_generation_prompt=True
            )
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            return error(400, f"chat template: {e}", param="messages")
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        return await run(request, req, [ids], chat=True)

    return app
