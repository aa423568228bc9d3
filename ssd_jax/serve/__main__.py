"""``python -m ssd_jax.serve``: an OpenAI-compatible HTTP server (see :mod:`ssd_jax.serve`).

Loads the model (and draft), compiles every program, then serves on ``--host:--port`` until
SIGTERM / Ctrl-C: new connections stop, in-flight requests get ``--shutdown-timeout`` seconds to
finish, what is left is cancelled, and the process exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import signal
import sys

from ssd_jax.cli.args import Parser, add_log_level, add_model_args, add_spec_args, spec_from_args
from ssd_jax.parallel.distributed import is_main

log = logging.getLogger("ssd_jax.serve")  # not __name__: run with -m, this module is __main__


def build_parser() -> Parser:
    p = Parser(prog="python -m ssd_jax.serve", description=__doc__.split("\n")[0])
    add_model_args(p)
    add_spec_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-batch", type=int, default=8, help="slots: sequences decoded together")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="KV-cache slots per sequence (prompt + generated + K + 1), capped by the model's context window",
    )
    g.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens prefilled per call")
    g.add_argument(
        "--context-buckets",
        type=int,
        default=None,
        help="attention windows compiled: --max-model-len "
        "halved this many times minus one; a round attends over the smallest window that holds every "
        "running context (1: always the whole cache). Default: 1 where the CPU attention kernel runs "
        "(it reads only the slots a row has, whatever the window), else 4",
    )
    g.add_argument(
        "--batch-buckets",
        type=int,
        default=4,
        help="batch sizes compiled: --max-batch halved this many times minus one; a round runs the "
        "smallest that holds every running request (AR and SD on one device; 1: always every slot)",
    )
    g.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="blocks in the paged KV cache's pool (default: enough for every slot's whole context, "
        "--max-batch x --max-model-len / --block-size; fewer: sequences are preempted and recomputed "
        "when it runs out; 0: no paging, a contiguous cache per slot). AR, SD and SSD, each model on one device",
    )
    g.add_argument("--block-size", type=int, default=16, help="KV-cache slots per block")
    g.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not reuse cached blocks of earlier prompts' prefixes",
    )
    g.add_argument(
        "--max-waiting", type=int, default=64, help="sequences that may wait for a slot; more get 429"
    )
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    g.add_argument(
        "--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM"
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the /v1 routes (default: $SSD_JAX_API_KEY; "
        "/health and /metrics stay open)",
    )
    add_log_level(g, "; uvicorn's own lines show at warning and above, or at debug")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="one process of a launcher run (python -m ssd_jax.launch ... serve, which adds it): process 0 "
        "serves HTTP, process 1 runs SSD's draft (ssd_jax.serve.lockstep)",
    )
    from ssd_jax.cli.decode import add_link_host

    add_link_host(g)
    return p


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.distributed:
        from ssd_jax.cli.decode import run_distributed

        return run_distributed(_serve, args)
    return _serve(args)


def _serve(args) -> int:
    from ssd_jax.compile import XLA_COMPILES

    XLA_COMPILES.start()  # every compilation of the process is counted: /metrics splits them at warm-up's end
    spec = _checked_spec(args)
    import uvicorn

    from ssd_jax import load_model
    from ssd_jax.serve.app import build_app

    model = load_model(args.target, dtype=args.dtype)
    spec, k_note, plan = _planned(args, spec, model)
    draft = spec.draft if spec.method != "ar" and not isinstance(spec.draft, str) else None
    max_len = min(args.max_model_len, model.cfg.max_position_embeddings)
    if draft is not None:
        max_len = min(max_len, draft.cfg.max_position_embeddings)
    engine, metrics, method = _serving_engine(args, spec, model, max_len)
    if engine.channel is not None and not is_main():  # process 1: the same engine, stepped as process 0 says
        return _follow(engine)
    _plan_gauges(metrics, spec, plan, method)
    name = args.served_model_name or str(args.target)
    k = 0 if spec.method == "ar" else int(spec.k)
    ssd = (
        f" fan-out budget={method.M} saguaro-c={spec.saguaro_c}{method.bucket_note()}"
        if spec.method == "ssd"
        else ""
    )
    log.info(
        f"[serve] {name} method={spec.method}"
        + (f" draft={args.draft} k={k}{k_note}{ssd}" if k else "")
        + f" slots={args.max_batch} buckets={','.join(map(str, method.buckets))} context={max_len} "
        f"windows={','.join(map(str, engine.windows))}{_paged_note(engine.engine)}{_layout_note()}: "
        f"compiled in {engine.engine.compile_s:.1f}s; "
        f"http://{args.host}:{args.port}/v1"
    )
    import os

    api_key = args.api_key or os.environ.get("SSD_JAX_API_KEY") or None
    app = build_app(engine, name, metrics, api_key=api_key)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level if args.log_level in ("debug", "error") else "warning",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = _server_class()(config)
    dead: list[bool] = []
    if engine.channel is not None:  # a dead peer: its requests have failed; the server ends, non-zero

        def on_dead():
            dead.append(True)
            server.should_exit = True

        engine.on_dead = on_dead
    XLA_COMPILES.mark()  # warm: whatever compiles from here on is counted, and logged, as serving's
    server.run()
    if engine.channel is not None:
        if dead:
            from ssd_jax.parallel.distributed import fail_fast

            fail_fast(f"the server stopped: the engine failed ({engine.error})")
        engine.channel.stop()  # process 1 leaves its loop; both meet at the shutdown barrier
    return 0


def _follow(engine) -> int:
    """Process 1 of a launcher run: ignore SIGTERM (process 0 says when to stop, after its in-flight
    requests), step the engine as told; a lost process 0 ends it with one line."""
    from ssd_jax.parallel.distributed import fail_fast
    from ssd_jax.parallel.link import PeerAborted, WireError
    from ssd_jax.serve.lockstep import LockstepError, follow

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from ssd_jax.compile import XLA_COMPILES

    XLA_COMPILES.mark()
    log.info("[serve] process 1: following process 0's steps")
    try:
        follow(engine.engine, engine.channel)
    except (LockstepError, WireError, PeerAborted) as e:  # the peer broke the protocol, or we diverged
        fail_fast(" ".join(str(e).split())[:500])
    except (RuntimeError, OSError) as e:
        fail_fast(f"lost process 0 ({' '.join(str(e).split())[:200]})")
    return 0


def _plan_gauges(metrics, spec, plan, method) -> None:
    """``ssd_jax:plan_expected_speedup`` per batch bucket the method runs: SD's plan per bucket, SSD's
    timed switch on one device, else the plan's one prediction (at --max-batch rows) for every bucket;
    1 for AR rounds. Nothing where no prediction was made (a K given)."""
    from ssd_jax.planning import BucketPlans, BucketSwitch

    policy = spec.k_plan
    if spec.method == "ar":
        by_bucket = dict.fromkeys(method.buckets, 1.0)
    elif isinstance(policy, BucketPlans):
        by_bucket = policy.expected()
    elif isinstance(policy, BucketSwitch) and method.bucket_costs:
        by_bucket = {
            b: 1.0 if b in method.ar_buckets else c["expected_speedup"]
            for b, c in method.bucket_costs.items()
        }
    elif plan.predicted and plan.predicted.get("expected_speedup") is not None:
        by_bucket = dict.fromkeys(method.buckets, float(plan.predicted["expected_speedup"]))
    else:
        return
    for b, x in by_bucket.items():
        metrics.plan_speedup.labels(batch=str(b)).set(x)


def _layout_note() -> str:
    from ssd_jax.parallel.distributed import multi_process

    return " processes=2 (draft on process 1)" if multi_process() else ""


def _checked_spec(args):
    """The speculation config from the flags, checked; "auto" draft options resolved where nothing is
    left to choose."""
    from ssd_jax.errors import UserError
    from ssd_jax.parallel.distributed import multi_process

    # the default draft is the draft model, not a head: a head's target cache is not paged yet
    spec = spec_from_args(args, paged=True)
    if args.context_buckets is None:
        args.context_buckets = _default_context_buckets()
    if (
        min(args.max_batch, args.prefill_chunk, args.context_buckets, args.batch_buckets, args.block_size) < 1
        or args.max_waiting < 0
        or (args.kv_blocks is not None and args.kv_blocks < 0)
    ):
        raise UserError(
            "--max-batch, --prefill-chunk, --context-buckets, --batch-buckets and --block-size must be >= 1, "
            "--max-waiting and --kv-blocks >= 0"
        )
    spec.validate()
    if multi_process() and not (
        spec.method == "ssd"
        and spec.target_devices is not None
        and spec.draft_devices is not None
        and jax_process_count() == 2
    ):
        raise UserError(
            "under the launcher the server runs SSD with its draft in the second process: "
            "python -m ssd_jax.launch --processes 2 serve --method ssd --target-devices N --draft-devices N ..."
        )
    if spec.method == "ar" or spec.draft in ("ngram", "random"):  # nothing for "auto" to choose
        spec = dataclasses.replace(
            spec,
            draft_dtype=None if spec.draft_dtype == "auto" else spec.draft_dtype,
            draft_vocab=None if spec.draft_vocab == "auto" else spec.draft_vocab,
        )
    return spec


def _planned(args, spec, model):
    """(the spec the engine serves, the start-up line's note on K): the planner
    (:func:`ssd_jax.planning.configure`) at --max-batch rows and every batch bucket. SD chooses K per
    round by the running rows' bucket, K = 0 (AR rounds) where no K is expected to pay; SSD on one device
    runs AR rounds at the buckets where its timed round does not pay. A warning where the plan expects
    the method to lose to AR at its best K."""
    from ssd_jax.decoding.slots import batch_buckets
    from ssd_jax.drafters.vocab import load_with_head
    from ssd_jax.planning import BucketPlans, BucketSwitch, configure

    load = functools.partial(load_with_head, dtype=model.cfg.dtype)  # as ssd_jax.generate loads drafts
    buckets = batch_buckets(args.max_batch, args.batch_buckets)
    spec, plan = configure(model, spec, rows=args.max_batch, load=load, buckets=buckets, serving=True)
    log.info(f"[serve] {plan.line()}")
    info, policy = plan.k_auto, spec.k_plan
    if spec.method == "ar" or info is None or "alpha" not in info:
        return spec, "" if info is None else f" (auto: {info['source']})", plan
    if isinstance(policy, BucketSwitch):  # the buckets' choice is made once the rounds are compiled and timed
        return (
            spec,
            f" (auto: alpha {info['alpha']:.2f}, {policy.tokens_per_round:.2f} tokens a round; {info['source']})",
            plan,
        )
    if isinstance(policy, BucketPlans):
        return (
            spec,
            f" (auto: alpha {info['alpha']:.2f}; by running rows {policy.summary()}; {info['source']})",
            plan,
        )
    expected = plan.predicted["expected_speedup"]
    if policy is not None and policy.k_for(None, policy.alpha) == 0:
        return (
            spec,
            f" (auto: alpha {info['alpha']:.2f}, K=0: AR rounds until acceptance pays; {info['source']})",
            plan,
        )
    if expected < 1.0:
        log.warning(
            f"[serve] warning: at {args.max_batch} rows the plan expects --method {spec.method} to run at "
            f"{expected:.2f}x AR even at its best K ({spec.k}); --method ar may serve faster (docs/serving.md)"
        )
    return spec, f" (auto: alpha {info['alpha']:.2f}, expected {expected:.2f}x AR, {info['source']})", plan


def jax_process_count() -> int:
    import jax

    return jax.process_count()


def _default_context_buckets() -> int:
    """1 where the CPU attention kernel serves decode and verify blocks (its cost follows each row's
    context, not the window: measured equal at 256 and 2,048 slots, docs/serving.md), else 4 (XLA's
    attention reads every slot of the window)."""
    import jax

    from ssd_jax.models import kernels

    return 1 if jax.default_backend() == "cpu" and kernels.available() else 4


def _paged_note(core) -> str:
    if core.pages is None:
        return " kv=contiguous"
    pool = core.pages.pool
    return f" kv=paged:{pool.n_blocks}x{pool.block_size} prefix-caching={'on' if pool.caching else 'off'}"


def _serving_engine(args, spec, model, max_len):
    """(the serving engine, its metrics, the method): every program compiled."""
    from ssd_jax import load_model
    from ssd_jax.engine.core import ALL_MODES, Engine
    from ssd_jax.engine.methods import build_method
    from ssd_jax.serve.engine import ServingEngine
    from ssd_jax.serve.metrics import Metrics

    from ssd_jax.parallel.distributed import multi_process

    from ssd_jax.compile import XLA_COMPILES

    metrics = Metrics(0 if spec.method == "ar" else int(spec.k))
    metrics.count_compiles(XLA_COMPILES)
    spec.validate()
    method = build_method(model, spec, ALL_MODES, load_model)
    core = Engine(
        method,
        max_batch=args.max_batch,
        max_len=max_len,
        prefill_chunk=args.prefill_chunk,
        metrics=metrics,
        context_buckets=args.context_buckets,
        batch_buckets=args.batch_buckets,
        admit_together=False,
        kv_blocks=args.max_batch * -(-max_len // args.block_size)
        if args.kv_blocks is None
        else args.kv_blocks or None,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
    )
    channel = None
    if multi_process():  # step messages to process 1 (ssd_jax.serve.lockstep), once both agree on the engine
        from ssd_jax.serve.lockstep import Channel, engine_config

        channel = Channel(engine_config(core, spec))
    return ServingEngine(core, max_waiting=args.max_waiting, channel=channel), metrics, method


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGTERM / SIGINT end it with status 0: uvicorn re-raises the signal
        after its graceful shutdown, which would kill the process with it."""

        @contextlib.contextmanager
        def capture_signals(self):
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server


def main(argv=None) -> int:
    from ssd_jax.errors import cli_main

    return cli_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
