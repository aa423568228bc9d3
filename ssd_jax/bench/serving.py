"""Serving benchmark: Poisson load on ``python -m ssd_jax.serve`` (issue 16).

``python -m ssd_jax.bench.serving --target NAME --methods ar sd:ngram:3 sd:DRAFT:2 ssd:DRAFT:2 --rates 0.5 1 2 ...``

- **Servers.** One server per method (a method may carry server flags of its own, e.g. ``"ar
  --no-prefix-caching"``), started one after another (each calibrates K auto on a quiet machine)
  and all kept up (an idle server's engine thread sleeps on a condition), so the methods can be interleaved:
  for each repeat and each rate, every method takes its load in an order rotated per (repeat,
  rate). Each server is warmed up with a few requests first.
- **Load.** ``--requests`` requests per (method, rate, repeat) with exponential inter-arrival
  times (a Poisson process at ``rate`` requests/s; the same seeded arrival times and prompts for
  every method), prompts from the offline sets (``--categories`` in turn; distinct prompts in every
  (repeat, rate) cell, so none is found whole in a prefix cache), through the chat
  endpoint with streaming, greedy, ``max_tokens`` fixed and ``ignore_eos`` so every request
  asks for the same work whatever the method. ``--system-tokens N`` puts the same N-token
  system message before every request (a shared system prompt: what prefix caching serves).
- **Per request** (one JSON line in ``<out>.jsonl``, appended and fsynced, so a rerun resumes):
  TTFT (arrival to first content chunk), TPOT ((end - first token) / (tokens - 1)), end-to-end
  latency, completion tokens (from the final usage chunk).
- **Per (method, rate)** (``<out>.md``): output-token throughput (tokens / (last finish - first
  arrival)) as the mean over repeats with a 95% t-interval, TTFT / TPOT / end-to-end p50 and p99
  over all requests of the cell, acceptance (and SSD's cache hit rate) from the server's ``/metrics``
  counters, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ssd_jax.bench.serving_load import poisson_arrivals, run_closed, run_load, system_prompt
from ssd_jax.bench.stats import mean_ci
from ssd_jax.bench.sweep import append_row, read_results
from ssd_jax.errors import UserError


def parse_method(m: str) -> dict:
    """``ar`` | ``sd:DRAFT[:K]`` | ``ssd:DRAFT[:K]`` (DRAFT: ngram (SD only) or a draft name / path; K an
    integer or auto, the default), optionally followed by server flags of its own (``"ar
    --no-prefix-caching"``) -> server flags and a label (``ar+no-prefix-caching``)."""
    spec, *own = shlex.split(m) or [""]
    if own and not own[0].startswith("--"):
        raise UserError(f"method {m!r}: what follows the method must be server flags (--...)")
    out = _parse_spec(spec, m)
    out["launch"] = "--launch" in own
    if out["launch"]:  # SSD's draft in a process of its own: the server under the launcher
        if not spec.startswith("ssd:"):
            raise UserError(f"method {m!r}: --launch serves SSD only (its draft in process 1)")
        own = [f for f in own if f != "--launch"]
        out["name"] += "+launch"
        out["flags"] = out["flags"] + ["--target-devices", "1", "--draft-devices", "1"]
    if own:
        out["name"] += "+" + "+".join(f.lstrip("-") for f in own)
        out["flags"] = out["flags"] + own
    return out


def _parse_spec(m: str, whole: str) -> dict:
    parts = m.split(":")
    if parts == ["ar"]:
        return {"name": "ar", "flags": ["--method", "ar"]}
    if (
        parts[0] in ("sd", "ssd")
        and len(parts) in (2, 3)
        and parts[1]
        and not (parts[0] == "ssd" and parts[1] == "ngram")
    ):
        k = parts[2] if len(parts) == 3 else "auto"
        if k != "auto" and (not k.isdigit() or int(k) < 1):
            raise UserError(f"method {whole!r}: K must be a positive integer or auto")
        label = "ngram" if parts[1] == "ngram" else "draft"
        return {
            "name": f"{parts[0]}-{label}-k{k}",
            "flags": ["--method", parts[0], "--draft", parts[1], "--k", k],
        }
    raise UserError(f"unknown method {whole!r} (ar, sd:ngram:K, sd:DRAFT:K, ssd:DRAFT:K, then server flags)")


def percentile(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else math.nan


# --- one server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``python -m ssd_jax.serve`` subprocess on a free local port; ``launch``: under ``python -m
    ssd_jax.launch --processes 2`` (SSD's draft in process 1); ``cores``: the cores it may use (one
    process: all of them; launched: one each, in order)."""

    def __init__(
        self, target: str, flags: list[str], extra: list[str], log_path: Path, launch=False, cores=None
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        env = dict(os.environ)
        env.pop("SSD_JAX_CPUS", None)
        cmd = [sys.executable, "-m", "ssd_jax.serve"]
        if launch:
            cmd = [sys.executable, "-m", "ssd_jax.launch", "--processes", "2"]
            cmd += ["--cpus-per-process", "1", "serve"] if cores else ["serve"]
        elif cores:
            env["SSD_JAX_CPUS"] = ",".join(map(str, cores))  # ssd_jax.xla_env pins it before JAX starts
        cmd += ["--target", target, "--port", str(self.port), *flags, *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env)

    def wait_ready(self, timeout: float = 900) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise UserError(f"server exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise UserError(f"server did not start within {timeout:.0f} s (log: {self.log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def counters(self) -> dict[str, float]:
        """The server's ``/metrics`` counters (label-free and per-label sums), and per batch bucket its
        rounds (``rounds|B``) and the plan's predicted speedup (``plan|B``)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.name] = out.get(s.name, 0.0) + s.value
                if s.name == "ssd_jax:spec_decode_num_rounds_total":
                    key = f"rounds|{s.labels['batch']}"
                    out[key] = out.get(key, 0.0) + s.value
                if s.name == "ssd_jax:plan_expected_speedup":
                    out[f"plan|{s.labels['batch']}"] = s.value
        return out


# --- the load


def level_name(level) -> str:
    """A cell's load: a Poisson rate (a number, requests/s) or a fixed concurrency ("cN")."""
    return f"concurrency {level[1:]}" if isinstance(level, str) else f"{level:g} req/s"


def _level_key(level):
    return (isinstance(level, str), float(level[1:]) if isinstance(level, str) else level)


def cell_summary(reqs: list[dict], spans: list[tuple[float, int]]) -> dict:
    """One (method, rate) cell: throughput per repeat (tokens / span) with a 95% interval, latency percentiles."""
    ok = [r for r in reqs if r["ok"]]
    tput = [tok / span for span, tok in spans if span > 0]
    m, lo, hi = mean_ci(tput) if len(tput) > 1 else (tput[0] if tput else math.nan, math.nan, math.nan)
    out = {"requests": len(reqs), "failed": len(reqs) - len(ok), "throughput": [m, lo, hi]}
    for key in ("ttft", "tpot", "e2e"):
        xs = [r[key] for r in ok if r[key] is not None]
        out[key] = {"p50": percentile(xs, 50), "p99": percentile(xs, 99)}
    return out


def _ratio(before: dict, after: dict, num: str, den: str) -> float | None:
    """The ratio of two counters' increments between two ``/metrics`` reads (None without any)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n, m = (
        d.get(f"ssd_jax:spec_decode_num_{num}_total", 0.0),
        d.get(f"ssd_jax:spec_decode_num_{den}_total", 0.0),
    )
    return n / m if m else None


def predicted_speedup(before: dict, after: dict) -> float | None:
    """The plan's predicted speedup over AR for a cell: each bucket's prediction weighted by the rounds
    the server ran at that bucket during the cell (a server that runs every slot: its one prediction)."""
    plans = {k.split("|")[1]: v for k, v in after.items() if k.startswith("plan|")}
    rounds = {b: after.get(f"rounds|{b}", 0.0) - before.get(f"rounds|{b}", 0.0) for b in plans}
    total = sum(rounds.values())
    if not plans:
        return None
    if total <= 0:
        return plans[max(plans, key=int)] if len(set(plans.values())) == 1 else None
    return sum(plans[b] * n for b, n in rounds.items()) / total


def _spec_acceptance(before: dict, after: dict) -> float | None:
    return _ratio(before, after, "accepted_tokens", "draft_tokens")


def _prefix_hits(before: dict, after: dict) -> float | None:
    """The share of prompt tokens found in the prefix cache between two ``/metrics`` reads."""
    q, h = (after.get(f"ssd_jax:prefix_cache_{k}_total", 0.0) - before.get(f"ssd_jax:prefix_cache_{k}_total", 0.0)
            for k in ("queries", "hits"))  # fmt: skip
    return h / q if q else None


def _paired_ratio(mine: dict, base: dict) -> str:
    """The mean of per-repeat throughput ratios to AR's [95% t-interval] ("-" without AR)."""
    rs = [mine[k] / base[k] for k in mine if base.get(k)]
    if not rs:
        return "-"
    if len(rs) == 1:
        return f"{rs[0]:.2f}x"
    m, lo, hi = mean_ci(rs)
    return f"{m:.2f}x [{lo:.2f}, {hi:.2f}]"


def _avg(xs) -> str:
    return "-" if not xs else f"{sum(xs) / len(xs):.2f}"


def _load_range(rows: list[dict]) -> str:
    loads = [r["loadavg"] for r in rows if r.get("kind") == "load" and r.get("loadavg") is not None]
    return f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"


def render(rows: list[dict], env: dict) -> str:
    runs = [r for r in rows if r.get("kind") == "request"]
    cells: dict[tuple, list[dict]] = {}
    spans: dict[tuple, list] = {}
    acc: dict[tuple, list] = {}
    hits: dict[tuple, list] = {}
    prefix: dict[tuple, list] = {}
    pred: dict[tuple, list] = {}
    preempt: dict[tuple, float] = {}
    per_rep: dict[tuple, dict] = {}  # (method, rate) -> {repeat: throughput}
    for r in rows:
        key = (r.get("method"), r.get("rate"))
        if r.get("kind") == "request":
            cells.setdefault(key, []).append(r)
        elif r.get("kind") == "load":
            spans.setdefault(key, []).append((r["span"], r["tokens"]))
            if r["span"] > 0:
                per_rep.setdefault(key, {})[r.get("repeat")] = r["tokens"] / r["span"]
            if r.get("acceptance") is not None:
                acc.setdefault(key, []).append(r["acceptance"])
            if r.get("cache_hit_rate") is not None:
                hits.setdefault(key, []).append(r["cache_hit_rate"])
            if r.get("prefix_hit_rate") is not None:
                prefix.setdefault(key, []).append(r["prefix_hit_rate"])
            if r.get("predicted") is not None:
                pred.setdefault(key, []).append(r["predicted"])
            preempt[key] = preempt.get(key, 0.0) + r.get("preemptions", 0.0)
    lines = [
        f"# Serving benchmark: {env.get('target')}",
        "",
        f"{env.get('backend')} ({env.get('cores')} cores), jax {env.get('jax')}, commit {env.get('commit')}; "
        f"{env.get('requests')} requests per (method, rate, repeat), Poisson arrivals, chat endpoint, streamed, "
        f"greedy, {env.get('max_tokens')} tokens per request (ignore_eos), {env.get('max_batch')} slots; "
        f"methods interleaved per (repeat, rate)"
        + (f"; a shared {env['system_tokens']}-token system message" if env.get("system_tokens") else "")
        + f". Load average (1 min) at start: {env.get('loadavg')}; per cell: {_load_range(rows)}.",
        "",
        "Throughput = output tokens / (last finish - first arrival), mean over repeats [95% t-interval]; "
        "vs ar: the mean over repeats of the throughput ratio to AR in the same repeat (the same arrivals "
        "and prompts) [95% t-interval]. "
        "TTFT = arrival to first token; TPOT = (end - first token) / (tokens - 1); percentiles over all "
        "requests of the cell. Predicted: the server's start-up plan, its predicted decode speedup over AR "
        "per batch bucket weighted by the rounds it ran there in the cell.",
        "",
        "| load | method | requests (failed) | throughput tok/s [95% CI] | vs ar | predicted "
        "| TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | e2e p50 / p99 (s) | acceptance | SSD cache hits "
        "| prefix hits | preempted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rates = sorted({k[1] for k in cells}, key=_level_key)
    methods = list(dict.fromkeys(r["method"] for r in runs))
    for rate in rates:
        base = per_rep.get(("ar", rate), {})
        for m in methods:
            if (m, rate) not in cells:
                continue
            s = cell_summary(cells[(m, rate)], spans.get((m, rate), []))
            t = s["throughput"]
            ratio = _paired_ratio(per_rep.get((m, rate), {}), base)
            a, h, px = acc.get((m, rate)), hits.get((m, rate)), prefix.get((m, rate))
            lines.append(
                f"| {level_name(rate)} | {m} | {s['requests']} ({s['failed']}) | {t[0]:.1f} [{t[1]:.1f}, {t[2]:.1f}] | {ratio} "
                f"| {_avg(pred.get((m, rate)))}{'x' if pred.get((m, rate)) else ''} | {s['ttft']['p50']:.2f} / {s['ttft']['p99']:.2f} | {1e3 * s['tpot']['p50']:.0f} / "
                f"{1e3 * s['tpot']['p99']:.0f} | {s['e2e']['p50']:.2f} / {s['e2e']['p99']:.2f} "
                f"| {_avg(a)} | {_avg(h)} | {_avg(px)} | {preempt.get((m, rate), 0.0):.0f} |"
            )
    return "\n".join(lines) + "\n"


def _env(a) -> dict:
    import jax

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    return {
        "kind": "env",
        "target": a.target,
        "methods": a.methods,
        "rates": a.rates,
        "concurrency": a.concurrency,
        "requests": a.requests,
        "repeats": a.repeats,
        "max_tokens": a.max_tokens,
        "max_batch": a.max_batch,
        "server_args": a.server_args,
        "categories": a.categories,
        "system_tokens": a.system_tokens,
        "cores_given": a.cores,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cores": os.cpu_count(),
        "commit": commit,
        "loadavg": os.getloadavg()[0],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ssd_jax.bench.serving", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument(
        "--methods",
        nargs="+",
        default=["ar", "sd:ngram:3"],
        help="ar | sd:ngram[:K] | sd:DRAFT[:K] | ssd:DRAFT[:K] (K: an integer or auto, the default)",
    )
    p.add_argument("--rates", type=float, nargs="*", default=[0.5, 1.0, 2.0], help="requests per second")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[],
        help="closed loops of this many clients (cells of their own)",
    )
    p.add_argument("--requests", type=int, default=16, help="requests per (method, rate, repeat)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--categories", nargs="+", default=["code", "chat", "math", "copy"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--system-tokens", type=int, default=0, help="a shared system message of about this many tokens"
    )
    p.add_argument("--warmup", type=int, default=4, help="requests per server before measuring")
    p.add_argument(
        "--server-args",
        default="",
        help="more flags for every server, one string (e.g. '--context-buckets 2 --prefill-chunk 32')",
    )
    p.add_argument(
        "--cores",
        type=int,
        nargs="+",
        default=None,
        help="hardware-fair runs: a one-process server may use the first of these cores only, a launched "
        "one (a method with --launch) the first for its target and the second for its draft",
    )
    p.add_argument("--out", required=True, help="results prefix: writes <out>.jsonl and <out>.md")
    p.add_argument("--report-only", action="store_true")
    return p


def _measure_cell(
    jsonl: Path, s: Server, name: str, rate: float, rep: int, a, prompts, arrivals, system: str | None
) -> None:
    """One (method, rate, repeat) cell: the load on server ``s``, each request and the cell's totals
    appended to ``jsonl``."""
    before, load = s.counters(), os.getloadavg()[0]
    if isinstance(arrivals, int):
        reqs = asyncio.run(run_closed(s.url, a.target, prompts, arrivals, a.max_tokens, system))
    else:
        reqs = asyncio.run(run_load(s.url, a.target, prompts, arrivals, a.max_tokens, system))
    after = s.counters()
    for i, r in enumerate(reqs):
        append_row(jsonl, {"kind": "request", "method": name, "rate": rate, "repeat": rep, "i": i, **r})
    ok = [r for r in reqs if r["ok"]]
    span = max(r["end"] for r in reqs) - min(r["arrival"] for r in reqs)
    tokens = sum(r["tokens"] for r in ok)
    cell = {"kind": "load", "method": name, "rate": rate, "repeat": rep, "span": span, "tokens": tokens,
            "failed": len(reqs) - len(ok), "loadavg": load, "acceptance": _spec_acceptance(before, after),
            "cache_hit_rate": _ratio(before, after, "cache_hits", "cache_lookups"),
            "prefix_hit_rate": _prefix_hits(before, after), "predicted": predicted_speedup(before, after),
            "preemptions": after.get("ssd_jax:num_preemptions_total", 0.0)
            - before.get("ssd_jax:num_preemptions_total", 0.0)}  # fmt: skip
    append_row(jsonl, cell)
    print(
        f"rep {rep} {level_name(rate)} {name}: {tokens / span:.1f} tok/s, {cell['failed']} failed",
        file=sys.stderr,
    )


def run(argv=None) -> int:
    a = build_parser().parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl, md = out.with_suffix(".jsonl"), out.with_suffix(".md")
    methods = [parse_method(m) for m in a.methods]
    if a.report_only:
        return _report(jsonl, md)
    prompts = _prompts(a)
    rows = read_results(jsonl)
    done = {(r["method"], r["rate"], r["repeat"]) for r in rows if r.get("kind") == "load"}
    env = _env(a)
    append_row(jsonl, env)
    extra = [
        "--max-batch",
        str(a.max_batch),
        "--max-model-len",
        str(a.max_model_len),
        "--max-waiting",
        str(4 * a.requests),
        *shlex.split(a.server_args),
    ]
    system = None
    if a.system_tokens > 0:
        from ssd_jax import load_model

        system = system_prompt(load_model(a.target).tokenizer, a.system_tokens)
    servers = {}
    try:
        for m in methods:
            cores = None if a.cores is None else (a.cores[:2] if m["launch"] else a.cores[:1])
            s = servers[m["name"]] = Server(
                a.target, m["flags"], extra, out.parent / f"{out.name}.{m['name']}.log", m["launch"], cores
            )
            s.wait_ready()  # one at a time: K auto calibrates on a quiet machine
        for name, s in servers.items():
            # the warm-up also puts the shared system prompt in a prefix cache, as a running server has it
            asyncio.run(
                run_load(
                    s.url,
                    a.target,
                    prompts[len(prompts) - a.warmup :],
                    [0.0] * a.warmup,
                    a.max_tokens,
                    system,
                )
            )
            print(f"{name}: ready on {s.url}", file=sys.stderr)
        _measure_cells(jsonl, servers, a, prompts, system, done)
    finally:
        for s in servers.values():
            s.stop()
    return _report(jsonl, md)


def _prompts(a) -> list[str]:
    """Distinct prompts for every (repeat, rate) cell and the warm-up (a prompt seen before would be found
    whole in the prefix cache), categories alternating; cell ``c`` takes ``a.requests`` of them from
    ``c * a.requests``, the same ones for every method, and the warm-up the last ``a.warmup``."""
    from ssd_jax.bench.protocol import category_prompts

    cells = a.repeats * len(_levels(a))
    per = -(-(cells * a.requests + a.warmup) // len(a.categories))
    per_cat = [[r["prompt"] for r in category_prompts(c, per)] for c in a.categories]
    prompts = [p for group in zip(*per_cat) for p in group]  # categories alternating
    if any(not isinstance(p, str) for p in prompts):
        raise UserError("the serving benchmark sends text prompts; a category gave token ids")
    return prompts


def _measure_cells(jsonl: Path, servers: dict[str, Server], a, prompts, system: str | None, done) -> None:
    """Every (repeat, rate) cell not ``done``, its methods in an order rotated per cell; each cell's
    arrivals are seeded by (seed, repeat, rate), the same for every method."""
    names = list(servers)
    for rep in range(a.repeats):
        for ri, rate in enumerate(_levels(a)):
            arrivals = (
                poisson_arrivals(rate, a.requests, a.seed + 1000 * rep + ri)
                if not isinstance(rate, str)
                else int(rate[1:])  # a closed loop of this many clients
            )
            order = names[(rep + ri) % len(names) :] + names[: (rep + ri) % len(names)]
            for name in order:
                if (name, rate, rep) in done:
                    continue
                c = (rep * len(_levels(a)) + ri) * a.requests
                _measure_cell(
                    jsonl, servers[name], name, rate, rep, a, prompts[c : c + a.requests], arrivals, system
                )


def _levels(a) -> list:
    return list(a.rates) + [f"c{n}" for n in a.concurrency]


def _report(jsonl: Path, md: Path) -> int:
    """The markdown report of the results in ``jsonl``, written to ``md``."""
    rows = read_results(jsonl)
    md.write_text(render(rows, next((r for r in rows if r.get("kind") == "env"), {})))
    print(f"wrote {md}")
    return 0


def main(argv=None) -> int:
    from ssd_jax.errors import cli_main

    return cli_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
