"""One API request from submission to its response: a JSON body, or a stream of server-sent events.

A request's sequences (one per prompt and sample) report from the engine thread into an
``asyncio.Queue`` on the event loop; each report carries how many tokens (and log-probabilities) the
sequence had at that moment, so a streamed chunk's ``logprobs`` and ``usage`` match its text exactly.
Formats are OpenAI's (with vLLM's ``token_ids`` on each choice): ``text_completion`` /
``chat.completion`` objects, their chunks, ``[DONE]``, and OpenAI-style error objects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from ssd_jax.serve.engine import EngineDead, QueueFull, Sequence


def error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code=None
) -> JSONResponse:
    body = {"message": message, "type": kind, "param": param, "code": status if code is None else code}
    return JSONResponse({"error": body}, status)


@dataclasses.dataclass
class Server:
    """What every reply needs from the server: the engine, its metrics, the served name, the tokenizer."""

    engine: Any
    metrics: Any
    name: str
    tokenizer: Any


class Reply:
    """The sequences of one request and how to answer it (``chat``: the chat formats)."""

    def __init__(self, srv: Server, request: Request, req, plans, chat: bool, n_prompt: int):
        self.srv, self.request, self.req, self.chat, self.n_prompt = srv, request, req, chat, n_prompt
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue = asyncio.Queue()
        self.seqs = [Sequence(ids, sp, self._sink(j), index=i) for j, (ids, sp, i) in enumerate(plans)]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.offset = [0] * len(self.seqs)  # completions' text_offset: characters of tokens formatted so far

    def _sink(self, j: int):
        def report(kind: str, x) -> None:  # on the engine thread: snapshot the counts now
            s = self.seqs[j]
            n_tok = len(s.row.tokens) if s.row is not None else 0
            self.loop.call_soon_threadsafe(self.q.put_nowait, (j, kind, x, n_tok, len(s.logprobs or ())))

        return report

    async def respond(self):
        try:
            self.srv.engine.submit(self.seqs)
        except QueueFull as e:
            return error(429, str(e), kind="rate_limit_error")
        except EngineDead as e:
            return error(503, str(e), kind="server_error")
        if self.req.stream:
            return EventSourceResponse(self.events(), ping=None, sep="\n")
        return await self.whole()

    # --- accounting

    def usage(self, tokens: int | None = None) -> dict:
        gen = sum(len(s.row.tokens) for s in self.seqs if s.row is not None) if tokens is None else tokens
        return {"prompt_tokens": self.n_prompt, "completion_tokens": gen, "total_tokens": self.n_prompt + gen}

    def _finished(self) -> None:
        reasons = {s.finish_reason for s in self.seqs}
        self.srv.metrics.request_done(
            self.n_prompt, "abort" if "cancelled" in reasons else sorted(reasons)[0]
        )

    def _abort(self) -> None:
        self.srv.engine.cancel(self.seqs)
        self.srv.metrics.request_done(self.n_prompt, "abort")

    # --- a whole response

    async def whole(self):
        remaining = len(self.seqs)
        try:
            while remaining:
                try:
                    _, kind, *_ = await asyncio.wait_for(self.q.get(), 0.5)
                except asyncio.TimeoutError:
                    if await self.request.is_disconnected():
                        self._abort()
                        return Response(status_code=499)
                    continue
                remaining -= kind == "done"
        except asyncio.CancelledError:
            self._abort()
            raise
        self._finished()
        if any(s.finish_reason == "error" for s in self.seqs):
            return error(500, f"the engine failed: {self.srv.engine.error}", kind="server_error")
        choices = [self._choice(i, s) for i, s in enumerate(self.seqs)]
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.srv.name,
                "choices": choices, "usage": self.usage()}  # fmt: skip

    def _choice(self, i: int, s: Sequence) -> dict:
        text = s.row.text if s.row is not None else ""
        c: dict = {
            "index": i,
            "finish_reason": s.finish_reason,
            "token_ids": list(s.row.tokens) if s.row else [],
        }
        lp = self._logprobs(i, 0, len(s.logprobs)) if s.logprobs is not None else None
        if self.chat:
            c["message"], c["logprobs"] = {"role": "assistant", "content": text}, lp
        else:
            c["text"], c["logprobs"] = text, lp
        return c

    # --- log-probabilities in OpenAI's two formats

    def _token(self, t: int) -> str:
        return self.srv.tokenizer.decode([t], skip_special_tokens=False) if self.srv.tokenizer else str(t)

    def _logprobs(self, j: int, a: int, b: int) -> dict:
        """Sequence ``j``'s tokens ``a`` to ``b`` with their log-probabilities (``b - a`` entries)."""
        s = self.seqs[j]
        n_top = s.sampling.logprobs or 0
        entries = s.logprobs[a:b]
        toks = s.row.tokens[a:b]
        if self.chat:

            def one(t, lp):  # noqa: E306
                text = self._token(t)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}

            return {"content": [{**one(t, lp), "top_logprobs": [one(i, x) for i, x in top[:n_top]]}
                                for t, (lp, top) in zip(toks, entries)]}  # fmt: skip
        strs = [self._token(t) for t in toks]
        offsets = []
        for x in strs:
            offsets.append(self.offset[j])
            self.offset[j] += len(x)
        tops = []
        for x, (lp, top) in zip(strs, entries):
            d = {self._token(i): v for i, v in top[:n_top]}
            tops.append({**d, x: lp})  # the emitted token is always among them, as vLLM returns it
        return {"tokens": strs, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip

    # --- a stream of chunks

    def _chunk(self, choices, **extra) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.srv.name,
            "choices": choices,
        }
        return json.dumps({**body, **extra})

    def _piece(self, i: int, text: str | None = None, finish=None, first=False, lp=None) -> dict:
        if self.chat:
            if first:
                delta = {"role": "assistant", "content": text or ""}
            else:
                delta = {"content": text} if text else {}
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}

    async def events(self):
        remaining = len(self.seqs)
        sent_lp = [0] * len(self.seqs)  # log-probabilities already streamed, per sequence
        counts = [0] * len(self.seqs)  # tokens per sequence at its latest report
        try:
            if self.chat:
                for i in range(len(self.seqs)):
                    yield self._chunk([self._piece(i, first=True)])
            while remaining:
                i, kind, x, n_tok, n_lp = await self.q.get()
                s, counts[i] = self.seqs[i], n_tok
                if kind == "done" and x.finish_reason == "error":  # OpenAI streams an error object, then ends
                    remaining -= 1
                    msg = f"the engine failed: {self.srv.engine.error}"
                    yield json.dumps(
                        {"error": {"message": msg, "type": "server_error", "param": None, "code": 500}}
                    )
                    return
                lp = None
                if s.logprobs is not None:
                    lp, sent_lp[i] = self._logprobs(i, sent_lp[i], n_lp), n_lp
                extra = {"usage": self.usage(sum(counts))} if self.continuous_usage else {}
                if kind == "text":
                    yield self._chunk([self._piece(i, x, lp=lp)], **extra)
                else:
                    remaining -= 1
                    yield self._chunk([self._piece(i, finish=x.finish_reason, lp=lp)], **extra)
            self._finished()
            if self.include_usage:
                yield self._chunk([], usage=self.usage())
            yield "[DONE]"
        finally:
            if remaining:  # the client went away (or the server stops): free the slots
                self._abort()
