"""What clients send: OpenAI's request bodies (with vLLM's extensions), validated into the engine's terms.

Accepted as vLLM's OpenAI server accepts them from SDKs and benchmark clients: chat message content as a
string or a list of parts (text parts are joined with newlines, as vLLM joins them; an image, audio or
file part gets a clear 400: the models served here read text), ``max_completion_tokens`` (or the older
``max_tokens``), ``stream_options`` (``include_usage``, ``continuous_usage_stats``), ``ignore_eos``,
``min_tokens``, ``stop`` as a string, a list or null, and ``logprobs`` (completions: the number of top
alternatives; chat: ``logprobs`` with ``top_logprobs``). Options that would change the output and are not
implemented (penalties, ``logit_bias``, ``min_p``, structured output, tools, ``echo``, ``best_of`` above
``n``) are refused with a 400 naming the field, never ignored; unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ssd_jax.errors import UserError
from ssd_jax.sampling.filters import SamplingParams
from ssd_jax.sampling.logprobs import MAX_LOGPROBS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 0  # vLLM's extension; -1 also means off
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # refused unless left at their defaults (they would change the output)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    min_p: float | None = 0.0
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        """The fields set to something this server does not implement."""
        bad = [
            f
            for f, off in (
                ("presence_penalty", 0.0),
                ("frequency_penalty", 0.0),
                ("repetition_penalty", 1.0),
                ("min_p", 0.0),
            )  # fmt: skip
            if getattr(self, f) not in (None, off)
        ]
        bad += ["logit_bias"] if self.logit_bias else []
        bad += ["best_of"] if self.best_of not in (None, self.n) else []
        return bad

    def top_logprobs_wanted(self) -> int | None:  # the request class says how it asks
        return None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + [f for f in ("echo", "suffix") if getattr(self, f)]

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, where: str) -> str:
        """The message's text: a string, or its text parts joined with newlines."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for i, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                what = (
                    f"{kind!r} parts are not supported: the model reads text only"
                    if kind != "text"
                    else "no text"
                )
                raise UserError(f"{where}.content[{i}]: {what}")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported() + (["tools"] if self.tools else [])
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            bad.append("response_format")
        return bad

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise UserError("top_logprobs: needs logprobs set to true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (role, text content)."""
        return [{"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(self.messages)]


def sampling_of(req: _Common, n_prompt: int, *, served_name: str, room: int, seed: int) -> SamplingParams:
    """The request's sampling parameters for one prompt of ``n_prompt`` tokens; ``room``: the context
    left for prompt and answer (chat's default ``max_tokens`` is what it leaves); ``seed``: used when the
    request has none. Raises UserError (HTTP 400) on what cannot be served."""
    if req.model is not None and req.model != served_name:
        raise UserError(f"model {req.model!r} is not served here (served: {served_name!r})")
    if bad := req.unsupported():
        raise UserError(f"{bad[0]}: not supported by this server (leave it unset)")
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        max_tokens = room - n_prompt
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise UserError("stop: at most 4 non-empty strings")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise UserError(f"temperature must be in [0, 2], got {temperature}")
    if req.min_tokens > max_tokens:
        raise UserError(f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})")
    top_k = req.top_k or 0
    sp = SamplingParams(
        temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if top_k == -1 else top_k,
        seed=seed if req.seed is None else req.seed,
        max_new_tokens=max_tokens,
        stop=tuple(stop),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=req.top_logprobs_wanted(),
    )
    sp.validate()
    return sp
