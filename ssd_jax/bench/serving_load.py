"""The serving benchmark's load (:mod:`ssd_jax.bench.serving`): Poisson arrivals, a closed loop of a
fixed number of clients, and one streamed chat request as SDK-based benchmark clients send it (content
as a list of typed text parts, ``max_completion_tokens``, usage in the last chunk)."""

from __future__ import annotations

import asyncio
import json
import random
import time

from ssd_jax.errors import UserError


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """``n`` arrival offsets (s) of a Poisson process at ``rate`` per second, starting at 0."""
    if not rate > 0 or n < 1:
        raise UserError(f"--rates must be > 0 and --requests >= 1, got rate {rate}, n {n}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _one(
    client, url: str, model: str, prompt: str, max_tokens: int, t0: float, at: float, system: str | None
) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    start = time.perf_counter()
    # as SDK-based benchmark clients send it: content as a list of parts, max_completion_tokens
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    body = {
        "model": model,
        "messages": messages,
        "max_completion_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    first, tokens, status = None, None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in ch.get("choices") or []):
                first = time.perf_counter()
            if ch.get("usage"):
                tokens = ch["usage"]["completion_tokens"]
    end = time.perf_counter()
    ok = status == 200 and first is not None and tokens
    return {
        "status": status,
        "ok": bool(ok),
        "arrival": at,
        "ttft": (first - start) if first else None,
        "e2e": end - start,
        "tokens": tokens,
        "start": start - t0,
        "end": end - t0,
        "tpot": (end - first) / (tokens - 1) if ok and tokens > 1 else None,
    }


async def run_load(
    url: str,
    model: str,
    prompts: list[str],
    arrivals: list[float],
    max_tokens: int,
    system: str | None = None,
) -> list[dict]:
    """Send ``prompts[i]`` at ``arrivals[i]`` (s from now), streamed, each after the shared ``system``
    message if given; one record per request."""
    import httpx

    limits = httpx.Limits(max_connections=len(arrivals) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        t0 = time.perf_counter()
        return list(
            await asyncio.gather(
                *(
                    _one(client, url, model, prompts[i % len(prompts)], max_tokens, t0, at, system)
                    for i, at in enumerate(arrivals)
                )
            )
        )


async def run_closed(url: str, model: str, prompts: list[str], workers: int, max_tokens: int, system=None):
    """A closed loop: ``workers`` clients, each sending its next prompt as soon as its last request ended
    (an outside benchmark's fixed concurrency), until every prompt was sent; one record per request."""
    import httpx

    todo = iter(range(len(prompts)))
    out: list[dict] = []
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600), limits=httpx.Limits(max_connections=workers + 4)
    ) as c:
        t0 = time.perf_counter()

        async def worker():
            for i in todo:
                out.append(
                    await _one(c, url, model, prompts[i], max_tokens, t0, time.perf_counter() - t0, system)
                )

        await asyncio.gather(*(worker() for _ in range(workers)))
    return out


def system_prompt(tokenizer, n: int) -> str:
    """About ``n`` tokens of plain instructions (the built-in prose, repeated), cut at a token boundary."""
    from ssd_jax.planning.calibration import CAL_TEXTS

    text = "You are a careful assistant. Follow these notes. " + " ".join(CAL_TEXTS) * 8
    return tokenizer.decode(tokenizer.encode(text)[:n])
