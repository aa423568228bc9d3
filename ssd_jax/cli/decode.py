"""``python -m ssd_jax.decode``: generate text with AR, SD or SSD decoding.

With ``--json`` exactly one JSON object goes to stdout::

    {"method": ..., "outputs": [{"prompt", "text", "token_ids", ...}, ...],
     "metrics": {"generated_tokens", "tokens_per_s", "ttft_s", "tpot_s", "wall_s", "compile_s", ...}}

Without it, text streams to stdout as it is generated, followed by a summary line on stderr.
With no arguments the default model answers a built-in prompt. Bad input prints one line
to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ssd_jax.cli.args import DEFAULT_TARGET, Parser, add_model_args, add_spec_args, spec_from_args  # noqa: F401
from ssd_jax.cli.args import add_log_level

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m ssd_jax.decode", description=__doc__.split("\n")[0])
    add_model_args(p)
    g = p.add_argument_group("input")
    g.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help="one prompt per line, or JSONL with a 'prompt' (or 'text') field")
    g.add_argument("--prompt-ids", action="append", default=[], help="raw token ids '1,2,3' (repeatable)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt, run as one batch")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g = add_spec_args(p)
    g.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the device work (ssd)")
    g.add_argument(
        "--profile-stages",
        action="store_true",
        help="sd/ssd: time the draft, verify and sample "
        "stages separately (one call each per round, slower; default: one call per round on one device, "
        "stage times null; --trace implies it)",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() first (multi-host: "
        "run the same command on every host; meshes then span jax.devices() of all hosts)",
    )
    add_link_host(g)
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    add_log_level(g)
    return p


def read_prompts(args) -> list:
    prompts: list = list(args.prompt)
    if args.prompts_file:
        from ssd_jax.errors import UserError

        if not os.path.isfile(args.prompts_file):
            raise UserError(f"prompts file not found: {args.prompts_file}")
        with open(args.prompts_file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UserError(f"{args.prompts_file}:{n}: invalid JSON ({e.msg})") from None
                    text = obj.get("prompt", obj.get("text"))
                    if not isinstance(text, str):
                        raise UserError(f"{args.prompts_file}:{n}: JSON line has no 'prompt' string")
                    prompts.append(text)
                else:
                    prompts.append(line)
    for s in args.prompt_ids:
        from ssd_jax.errors import UserError

        try:
            prompts.append([int(t) for t in s.replace(" ", "").split(",") if t])
        except ValueError:
            raise UserError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None
    return prompts


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_distributed(_run, args) if args.distributed else _run(args)


def add_link_host(g) -> None:
    """``--link-host``: where process 0 listens for the others (docs/multiprocess.md)."""
    g.add_argument(
        "--link-host",
        default=None,
        metavar="ADDR",
        help="--distributed: the address process 0's link and coordination service listen on "
        "(default: $SSD_JAX_LINK_HOST, else 127.0.0.1 when the coordinator is on this host, else the "
        "coordinator's address; never every interface)",
    )


def run_distributed(fn, args) -> int:
    """``fn(args)`` as one process of a ``jax.distributed`` run (``--distributed``, set by
    ``python -m ssd_jax.launch``): initialise first, and turn any failure into one line and an
    immediate exit, so a peer is not left waiting in a collective or in JAX's shutdown barrier."""
    from ssd_jax.errors import UserError
    from ssd_jax.parallel import distributed as dist

    if getattr(args, "link_host", None):
        from ssd_jax.parallel.link import HOST_ENV

        os.environ[HOST_ENV] = args.link_host
    _native_stdout_to_stderr()
    try:  # coordinator / process ids from JAX_* variables or the cluster (TPU slice, SLURM)
        dist.initialize()
    except Exception as e:  # noqa: BLE001 - any start-up failure is one line
        dist.fail_fast(f"jax.distributed.initialize failed: {_first_line(e)}")
    try:
        rc = fn(args)
        dist.finish()
        return rc
    except UserError as e:  # exit now: a peer that did not fail would wait in JAX's shutdown barrier
        dist.fail_fast(str(e), e.exit_code)
    except KeyboardInterrupt:
        dist.fail_fast("interrupted", 130)
    except Exception as e:  # noqa: BLE001 - a lost peer surfaces as a runtime error in a collective
        dist.fail_fast(f"distributed run failed (a peer process may have died): {_first_line(e)}")
    return 1


def _native_stdout_to_stderr() -> None:
    """Native libraries write to file descriptor 1 (gloo prints "[Gloo] Rank 0 is connected ...").
    Send that to stderr and keep the real stdout for our output alone, so ``--json`` stays one object."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real, "w", buffering=1)


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def _run(args) -> int:
    from ssd_jax.errors import UserError
    from ssd_jax.sampling.filters import SamplingParams

    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        n=args.n,
    )
    sampling.validate()  # fail on bad flags before loading anything
    spec = spec_from_args(args)
    import jax

    spec.validate(n_devices=len(jax.devices()))
    if args.trace and args.method != "ssd":
        raise UserError("--trace records SSD rounds; use it with --method ssd")
    prompts = _prompts(args)

    from ssd_jax import generate, load_model  # the public API (load_model picks the device's default dtype)

    model = load_model(args.target, dtype=args.dtype)
    main = jax.process_index() == 0  # under --distributed only process 0 prints (and writes the trace)
    stream = main and not args.json and len(prompts) * args.n == 1

    def on_text(row, text):
        sys.stdout.write(text)
        sys.stdout.flush()

    res = generate(
        model, prompts, sampling, spec, chat=args.chat, on_text=on_text if stream else None, trace=args.trace
    )
    if not main:
        return 0
    if args.json:
        print(json.dumps(res.to_json()))
        return 0
    if stream:
        print()
    else:
        for i, o in enumerate(res.outputs):
            print(f"--- [{i}] {o['prompt'] if isinstance(o['prompt'], str) else o['prompt'][:8]}")
            print(o["text"])
    _report(res)
    return 0


def _prompts(args) -> list:
    """The prompts to decode (the default one, chat-templated, when none is given); empty ones refused."""
    from ssd_jax.errors import UserError

    prompts = read_prompts(args)
    if not prompts:
        if args.prompts_file:
            raise UserError(f"no prompts in {args.prompts_file}")
        prompts = [DEFAULT_PROMPT]
        args.chat = True
    for p in prompts:
        if isinstance(p, str) and not p.strip():
            raise UserError("empty prompt")
        if not isinstance(p, str) and not p:
            raise UserError("empty prompt (--prompt-ids)")
    return prompts


def _report(res) -> None:
    """The run's plan, speed, speculation and SSD lines on stderr."""
    m = res.metrics
    if m.get("plan") and res.method != "ar":
        print(f"[{res.method}] {m['plan']['line']}", file=sys.stderr)
    if (m.get("plan") or {}).get("forms"):
        print(f"[{res.method}] {m['plan']['forms']['line']}", file=sys.stderr)
    print(
        f"[{res.method}] {m['generated_tokens']} tokens in {m['wall_s']:.2f}s: {m['tokens_per_s']:.2f} tok/s, "
        f"ttft {m['ttft_s']:.3f}s, tpot {m['tpot_s'] * 1e3:.1f}ms, compile {m['compile_s']:.1f}s",
        file=sys.stderr,
    )
    if "acceptance_rate" in m:
        k_mean = f", mean {m['k_mean']:.1f}" if m.get("k_mean") else ""  # K adaptive: the K per round varied
        print(
            f"[{res.method}] draft {m['draft']} k={m['k']}{' (auto)' if m.get('k_auto') else ''}{k_mean}: acceptance {m['acceptance_rate']:.2f}, "
            f"{m['mean_acceptance_length']:.2f} tokens/verify step (incl. bonus), {m['verify_steps']} verify steps; "
            + (
                f"time draft {m['draft_s']:.2f}s verify {m['verify_s']:.2f}s sample {m['sample_s']:.2f}s "
                f"overhead {m['overhead_s']:.2f}s"
                if m.get("draft_s") is not None
                else "stage times: --profile-stages"
            ),
            file=sys.stderr,
        )
    if m.get("plan", {}).get("theorem7"):  # the plan's prediction, Theorem 7's bound, the measurement
        print(f"[ssd] {m['plan']['theorem7']['line']}", file=sys.stderr)
    ar_rounds = (m.get("plan") or {}).get("chosen", {}).get("ar_rounds")  # the plan ran no SSD rounds
    if "cache_hit_rate" in m and not ar_rounds:
        print(
            f"[ssd] cache hit rate {m['cache_hit_rate']:.2f} (whole batch {m['batch_cache_hit_rate']:.2f}), "
            f"tokens/round {m['tau_hit']:.2f} on hits, {m['tau_miss']:.2f} on misses; fan-out "
            f"{m['fanout']['mode']} {m['fanout']['schedule']}; fallbacks {m['fallback_calls']}; "
            + (
                f"build/verify overlap {m['overlap_fraction']:.2f}"
                if m.get("overlap_fraction") is not None
                else f"{m['calls_per_round']:.2f} compiled calls / round"
            ),
            file=sys.stderr,
        )


def main(argv=None) -> int:
    from ssd_jax.errors import cli_main

    return cli_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
