"""One request's admission (prefill) and its rounds alone, per method, in an 8-slot engine built as the
server builds it (every sampling mode compiled, batch buckets, a paged pool for AR and SD). SSD takes
``--backup`` (the server's default: auto) and K = 1 with a fan-out budget of 2 (what K auto chose for
SmolLM2 at 8 rows).

    python experiments/probes/serve_method_costs.py ar sd ssd [--backup auto|neural|ngram]
    python experiments/probes/serve_method_costs.py sd sd:64 --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --system-tokens 512 --new-tokens 8   # sd:W = --draft-context W

Prints per method the median admission time of 5 chat-templated code prompts (64-token chunks; behind a
shared system message of ``--system-tokens``, prefix caching off) and the median ms per token of each
request decoded alone (greedy), the first request a warm-up. ``--rows 1 2 4``: instead, that many
prompts admitted together and decoded to the end, twice per row count: ms per round and the wall time
over the tokens all rows produced (a row's own time per token is that times the rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np


def main() -> None:
    import ssd_jax
    from ssd_jax import SamplingParams, SpecConfig
    from ssd_jax.bench.serving import system_prompt
    from ssd_jax.data.prompts import load_prompts
    from ssd_jax.engine.core import ALL_MODES, Engine, Sequence
    from ssd_jax.engine.methods import build_method

    ap = argparse.ArgumentParser()
    ap.add_argument("methods", nargs="+", help="ar | sd | sd:W (--draft-context W) | ssd")
    ap.add_argument("--backup", default="auto")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--system-tokens", type=int, default=0)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--category", default="code", help="the prompt set")
    ap.add_argument("--rows", type=int, nargs="*", help="round cost by live rows (see above)")
    a = ap.parse_args()
    t = ssd_jax.load_model(a.target)
    d = ssd_jax.load_model(a.draft)
    plain = {"draft_dtype": None, "draft_vocab": None}
    specs = {
        "ssd": SpecConfig(method="ssd", draft=d, k=1, backup=a.backup, fan_out_budget=2, **plain),
        "sd": SpecConfig(method="sd", draft=d, k=1, **plain),
        "ar": SpecConfig(),
    }
    sp = SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True)
    tok = t.tokenizer
    system = [{"role": "system", "content": system_prompt(tok, a.system_tokens)}] if a.system_tokens else []
    prompts = [
        tok.encode(tok.apply_chat_template([*system, {"role": "user", "content": r["prompt"]}], add_generation_prompt=True),
                   add_special_tokens=False)
        for r in load_prompts(a.category, n=8)
    ]  # fmt: skip
    for name in a.methods:
        base, _, w = name.partition(":")
        spec = specs[base] if not w else dataclasses.replace(specs[base], draft_context=int(w))
        method = build_method(t, spec, ALL_MODES, lambda n: d)
        e = Engine(method, max_batch=8, max_len=1024, prefill_chunk=64, admit_together=False, batch_buckets=4,
                   kv_blocks=512, block_size=16, prefix_caching=False)  # fmt: skip
        if a.rows:
            by_rows(e, prompts, sp, name, a.rows, a.new_tokens)
            continue
        adm, per_tok = [], []
        for i, p in enumerate(prompts[:6]):
            s = Sequence(p, sp)
            e.submit([s])
            t0 = time.perf_counter()
            e.admit()
            a_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            e.run()
            if i:  # the first request is a warm-up
                adm.append(a_s)
                per_tok.append((time.perf_counter() - t1) / (a.new_tokens - 1))
        print(
            f"{name}: admission {1e3 * np.median(adm):.0f} ms (prompts of {[len(p) for p in prompts[1:6]]} tokens), "
            f"alone {1e3 * np.median(per_tok):.1f} ms a token",
            flush=True,
        )


def by_rows(e, prompts, sp, name: str, rows_list, new: int) -> None:
    """Each row count twice: that many prompts admitted together, then decoded to the end."""
    from ssd_jax.engine.core import Sequence

    for rows in [*rows_list, *rows_list]:
        e.submit([Sequence(p, sp) for p in prompts[:rows]])
        while e.waiting:
            e.step()
        r0, t0 = e.rounds, time.perf_counter()
        e.run()
        dt = time.perf_counter() - t0
        print(f"{name} rows={rows}: {1e3 * dt / (e.rounds - r0):.1f} ms a round, "
              f"{1e3 * dt / (rows * (new - 1)):.1f} ms per row-token", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
