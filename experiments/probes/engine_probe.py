"""Host cost of the decoding loops: compiled calls per round, time per round, tok/s, and cost per token
against length (issue: engine redesign). Runs against whatever ``ssd_jax`` is importable, so the
driver ``experiments/probes/engine_compare.py`` can run it on the code before and after a change.

    python experiments/probes/engine_probe.py --out rows.jsonl [--tokens 1000] [--repeats 3] [--smollm]

The probe model is a 2-layer, width-64 Llama with random weights and a 128-token vocabulary
(the "probe" suite: nothing but the engine costs anything), or SmolLM2's vocabulary and
tokenizer (the "length" suite: detokenisation costs what it costs for real); drafts are the
target itself,
so every proposal is accepted and a round's cost is pure engine overhead. Every compiled call
is counted by wrapping ``ssd_jax.runtime.Compiled.__call__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time


def _env() -> dict:
    import jax

    import ssd_jax

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(ssd_jax.__file__))),
        ).stdout.strip()
    except OSError:
        commit = ""
    return {"jax": jax.__version__, "commit": commit, "loadavg": os.getloadavg()[0]}


def probe_model(vocab: int | None = None):
    """2 layers, width 64, random weights. ``vocab=None``: SmolLM2's vocabulary and tokenizer (so
    detokenisation costs what it costs for real); else that many ids and no tokenizer."""
    import ssd_jax
    from ssd_jax.models.params import init_params

    real = ssd_jax.load_model("smollm2-135m-instruct")
    cfg = real.cfg.replace(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        **({} if vocab is None else {"vocab_size": vocab}),
    )
    return dataclasses.replace(
        real,
        name="probe-2x64",
        cfg=cfg,
        params=init_params(cfg, 0, scale=0.1),
        tokenizer=real.tokenizer if vocab is None else None,
    )


def count_calls():
    from pathlib import Path

    import ssd_jax

    # decide by the files of the ssd_jax actually imported: an editable install would supply a
    # module missing from an older checkout from the current one
    if (Path(ssd_jax.__file__).parent / "compile.py").exists():
        from ssd_jax.compile import Compiled
    else:  # the layout before the engine redesign
        from ssd_jax.runtime import Compiled

    counts: dict[str, int] = {}
    orig = Compiled.__call__

    def counted(self, *a):
        counts[self.name] = counts.get(self.name, 0) + 1
        return orig(self, *a)

    Compiled.__call__ = counted
    return counts


def run_one(model, method, prompts, tokens, counts, draft=None, batch_n=1):
    from ssd_jax import SamplingParams, SpecConfig, generate

    spec = {
        "ar": SpecConfig(),
        "sd": SpecConfig(method="sd", draft=draft or model, k=3),
        "ngram": SpecConfig(method="sd", draft="ngram", k=3),
        "ssd": SpecConfig(method="ssd", draft=draft or model, k=3, backup="neural"),
    }[method]
    sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True, n=batch_n)
    generate(model, prompts, SamplingParams(max_new_tokens=8, ignore_eos=True, n=batch_n), spec)  # compile
    counts.clear()
    t = time.perf_counter()
    res = generate(model, prompts, sp, spec)
    wall = time.perf_counter() - t
    m = res.metrics
    rounds = m.get("verify_steps", m.get("steps", tokens))
    calls = sum(counts.values())
    decode_s = m["wall_s"] - m["ttft_s"]
    return {
        "method": method,
        "tokens": tokens,
        "batch": len(res.outputs),
        "wall_s": wall,
        "decode_tok_s": m["decode_tokens_per_s"],
        "e2e_tok_s": m["generated_tokens"] / wall,
        "rounds": rounds,
        "calls": calls,
        "calls_per_round": calls / max(rounds, 1),
        "ms_per_round": 1e3 * decode_s / max(rounds, 1),
        "ms_per_token": 1e3 * decode_s / max(1, m["generated_tokens"] - len(res.outputs)),
        "call_names": dict(counts),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lengths", type=int, nargs="*", default=[256, 512, 1024, 2048])
    p.add_argument(
        "--smollm", action="store_true", help="also SmolLM2-135M + its shipped draft at batch 1 and 16"
    )
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    counts = count_calls()
    small = probe_model(vocab=128)  # the engine's own overhead: nothing else costs anything
    model = probe_model()  # the same with SmolLM2's tokenizer: detokenisation against length
    prompt = [model.tokenizer.encode("def fibonacci(n):")]
    small_prompt = [[t % 128 for t in prompt[0]]]
    env = _env()
    rows = []

    def emit(row, **extra):
        row.update(extra, tag=args.tag, **env)
        row["loadavg_now"] = os.getloadavg()[0]
        rows.append(row)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            json.dumps(
                {
                    k: row[k]
                    for k in (
                        "tag",
                        "suite",
                        "method",
                        "tokens",
                        "batch",
                        "decode_tok_s",
                        "calls_per_round",
                        "ms_per_round",
                        "ms_per_token",
                    )
                }
            ),
            flush=True,
        )

    for r in range(args.repeats):  # methods interleaved within each repeat
        for method in ("ar", "sd", "ssd", "ngram"):
            emit(run_one(small, method, small_prompt, args.tokens, counts), suite="probe", repeat=r)
    for n in args.lengths:  # host cost per token against length
        for method in ("ar", "sd"):
            emit(run_one(model, method, prompt, n, counts), suite="length", repeat=0)
    if args.smollm:
        import ssd_jax
        from ssd_jax.drafters import default_draft

        target = ssd_jax.load_model("smollm2-135m-instruct")
        draft = ssd_jax.load_model(default_draft("smollm2-135m-instruct"))
        texts = ["def is_prime(n):", "Write a haiku about the sea.", "The capital of France is"]
        ids = [target.tokenizer.encode(t) for t in texts]
        for batch_n in (1, 16):
            for r in range(2):
                for method in ("ar", "sd", "ngram", "ssd"):
                    row = run_one(
                        target, method, ids[r % len(ids) :][:1], 32, counts, draft=draft, batch_n=batch_n
                    )
                    emit(row, suite=f"smollm-b{batch_n}", repeat=r)


if __name__ == "__main__":
    main()
