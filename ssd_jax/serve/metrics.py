"""The server's Prometheus metrics, named as vLLM names them (prefix ``ssd_jax:`` for ``vllm:``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, k: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "ssd_jax:request_success",
            "Finished API requests by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ssd_jax:prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("ssd_jax:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "ssd_jax:time_to_first_token_seconds",
            "Arrival to first token, per sequence",
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "ssd_jax:time_per_output_token_seconds",
            "Mean time per token after the first, per sequence",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "ssd_jax:e2e_request_latency_seconds",
            "Arrival to last token, per sequence",
            buckets=_LATENCY,
            registry=r,
        )
        self.running = Gauge("ssd_jax:num_requests_running", "Sequences in a slot", registry=r)
        self.waiting = Gauge("ssd_jax:num_requests_waiting", "Sequences waiting for a slot", registry=r)
        self.drafts = Counter(
            "ssd_jax:spec_decode_num_drafts", "Verify steps (one per running row per round)", registry=r
        )
        self.draft_tokens = Counter("ssd_jax:spec_decode_num_draft_tokens", "Proposed tokens", registry=r)
        self.accepted = Counter(
            "ssd_jax:spec_decode_num_accepted_tokens", "Accepted proposed tokens", registry=r
        )
        self.accepted_per_pos = Counter(
            "ssd_jax:spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposals by position in the round",
            ["position"],
            registry=r,
        )
        for j in range(k):
            self.accepted_per_pos.labels(position=str(j))
        self.rounds = Counter(
            "ssd_jax:spec_decode_num_rounds",
            "Speculative rounds by their K (0: an AR round, the draft idle) and batch bucket (rows run)",
            ["k", "batch"],
            registry=r,
        )
        self.plan_speedup = _plan_gauge(r)
        self.prefix_queries = Counter(
            "ssd_jax:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "ssd_jax:prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)", registry=r
        )
        self.preemptions = Counter(
            "ssd_jax:num_preemptions", "Sequences preempted (paged cache full) to be recomputed", registry=r
        )
        self.kv_usage = Gauge(
            "ssd_jax:kv_cache_usage_perc",
            "Fraction of the paged cache's blocks held by sequences",
            registry=r,
        )
        self._prefix_seen = (0, 0)
        self.cache_lookups = Counter(
            "ssd_jax:spec_decode_num_cache_lookups",
            "SSD: speculation-cache lookups (one per running row per round)",
            registry=r,
        )
        self.cache_hits = Counter(
            "ssd_jax:spec_decode_num_cache_hits",
            "SSD: lookups whose outcome was in the speculation cache",
            registry=r,
        )

    def count_compiles(self, compiles) -> None:
        """Export a :class:`ssd_jax.compile.XlaCompiles`: ``ssd_jax:xla_compilations_total`` and
        ``ssd_jax:xla_compile_seconds_total`` by ``phase``, ``warmup`` (start-up) or ``serving`` (after
        the server was warm: 0 when every program a request can run was compiled before serving)."""
        self.registry.register(_Compiles(compiles))

    def sequence_done(self, s) -> None:
        """One sequence ended (engine thread): its tokens and latencies."""
        n = len(s.row.tokens) if s.row is not None else 0
        self.generation_tokens.inc(n)
        if s.first_token_at is None:
            return
        ttft = s.first_token_at - s.arrived
        self.ttft.observe(ttft)
        self.e2e.observe(s.finished_at - s.arrived)
        if n > 1:
            self.tpot.observe((s.finished_at - s.first_token_at) / (n - 1))

    def request_done(self, prompt_tokens: int, reason: str) -> None:
        """One API request answered (all its sequences)."""
        self.requests.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)

    def spec_round(self, n_acc, n_draft, k: int | None = None, bucket: int = 0) -> None:
        """One SD round over the running rows (``k``: its K where the method reports it)."""
        if k is not None:
            self.rounds.labels(k=str(k), batch=str(bucket)).inc()
        self.drafts.inc(len(n_acc))
        self.draft_tokens.inc(int(n_draft.sum()))
        self.accepted.inc(int(n_acc.sum()))
        for j in range(int(n_acc.max(initial=0))):
            self.accepted_per_pos.labels(position=str(j)).inc(int((n_acc > j).sum()))

    def cache_lookup(self, lookups: int, hits: int) -> None:
        """One SSD round's speculation-cache lookups."""
        self.cache_lookups.inc(lookups)
        self.cache_hits.inc(hits)

    def prefix_cache(self, pool) -> None:
        """After an admission: the pool's prefix-cache counts since the last call, and its usage."""
        q, h = self._prefix_seen
        self.prefix_queries.inc(pool.queries - q)
        self.prefix_hits.inc(pool.hits - h)
        self._prefix_seen = (pool.queries, pool.hits)
        self.kv_usage.set(pool.usage)

    def preempted(self) -> None:
        self.preemptions.inc()


def _plan_gauge(registry) -> Gauge:
    return Gauge(
        "ssd_jax:plan_expected_speedup",
        "The start-up plan's predicted decode speedup over AR for rounds of each batch bucket (rows run); "
        "1 where the bucket runs AR rounds",
        ["batch"],
        registry=registry,
    )


class _Compiles:
    """A collector reading the process's XLA compile count at each scrape."""

    def __init__(self, compiles):
        self.compiles = compiles

    def collect(self):
        c = self.compiles
        n = CounterMetricFamily(
            "ssd_jax:xla_compilations",
            "XLA compilations in this process (a persistent-cache load included), by phase: warmup (before "
            "the server was ready) or serving (after: a program compiled while requests wait)",
            labels=["phase"],
        )
        n.add_metric(["warmup"], c.count - c.since_mark)
        n.add_metric(["serving"], c.since_mark)
        s = CounterMetricFamily(
            "ssd_jax:xla_compile_seconds", "Seconds those compilations took, by phase", labels=["phase"]
        )
        serving_s = c.seconds - c.seconds_at_mark if c.marked else 0.0
        s.add_metric(["warmup"], c.seconds - serving_s)
        s.add_metric(["serving"], serving_s)
        yield n
        yield s
