"""Peer comparison under the benchmark protocol: HF transformers (CPU torch) and ssd_jax interleaved.

One process, the same weights, the same token-id prompts and the same thread count for both
(torch gets ``--threads``, default all cores; XLA:CPU always uses all cores, so keep the default):
HF plain ``generate``, HF assisted generation (the draft, K constant) and HF prompt lookup
(K tokens) run in the protocol's rotated order per unit with ssd_jax AR, SD, n-gram SD and SSD
(:mod:`ssd_jax.bench.protocol`: >= 8 prompts per category, >= 3 repeats, warm-up first,
resumable JSONL). Greedy, a fixed number of new tokens, chat-templated prompts.

Decode-only split for HF: a streamer records when the first generated tokens arrive (the
prefill, plus for assisted / lookup generation the first round) and how many; decode tok/s =
the tokens after that / the time after that, the same definition as ours (where the first
put holds exactly one token). End-to-end tok/s includes the prefill. Ratios are reported
against ssd_jax AR and against HF generate.

    .venv/bin/python tools/hf_compare.py [--n-prompts 8] [--repeats 3] [--new-tokens 64]
    .venv/bin/python tools/hf_compare.py --smoke     # tiny random Qwen2 pair, seconds

Weights: the registry's GGUF files, dequantised to float32 by transformers' reader and by ours
(default), or an HF folder pair (``--target-dir``/``--draft-dir``). Writes
``experiments/results/peer_hf_cpu.{jsonl,md}`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "experiments" / "results" / "peer_hf_cpu.jsonl"


class _FirstTokens:
    """A transformers streamer that notes when the first generated tokens arrive, and how many."""

    def __init__(self):
        self.puts = 0
        self.t_first = None
        self.n_first = 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:  # put 1 is the prompt
            self.t_first = time.perf_counter()
            self.n_first = int(value.numel())

    def end(self):
        pass


class HFRunner:
    """One HF generation method as a protocol runner (batch 1, token-id prompts)."""

    def __init__(self, model, **kwargs):
        self.model, self.kwargs = model, kwargs

    def warm(self, units, new_tokens):
        self(units[0].prompts, new_tokens)
        return 1

    def __call__(self, prompts, new_tokens):
        import torch

        if len(prompts) != 1:
            raise ValueError("the HF runners run batch 1")
        ids = list(prompts[0])
        st = _FirstTokens()
        t = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=st,
                **self.kwargs,
            )
        wall = time.perf_counter() - t
        toks = out[0, len(ids) :].tolist()
        n = len(toks)
        ttft = (st.t_first or t + wall) - t
        dec = (n - st.n_first) / (wall - ttft) if wall > ttft and n > st.n_first else 0.0
        return {
            "generated_tokens": n,
            "wall_s": wall,
            "ttft_s": ttft,
            "first_put_tokens": st.n_first,
            "decode_tok_s": dec,
            "e2e_tok_s": n / wall,
            "acceptance_rate": None,
            "tokens_per_round": None,
            "token_ids": [toks],
        }


def hf_models(target_src, draft_src):
    import torch
    from transformers import AutoModelForCausalLM

    def load(src):
        if isinstance(src, tuple):  # (folder, gguf file name)
            return AutoModelForCausalLM.from_pretrained(src[0], gguf_file=src[1], dtype=torch.float32).eval()
        return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()

    return load(target_src), load(draft_src)


def hf_runners(target, draft, k):
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return {
        "hf-generate": HFRunner(target),
        f"hf-assisted-k{k}": HFRunner(target, assistant_model=draft),
        f"hf-prompt-lookup-{k}": HFRunner(target, prompt_lookup_num_tokens=k),
    }


def tiny_pair(work: Path) -> tuple[str, str]:
    """Two tiny random Qwen2 folders (same vocabulary), saved by transformers: the --smoke models."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    paths = []
    for seed, layers in ((0, 2), (1, 1)):
        torch.manual_seed(seed)
        cfg = Qwen2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            eos_token_id=1,
        )
        m = Qwen2ForCausalLM(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0.0, 0.15)
        path = work / f"tiny-{seed}"
        m.save_pretrained(path, safe_serialization=True)
        paths.append(str(path))
    return paths[0], paths[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--target-dir", help="an HF folder instead of the registry's GGUF (with --draft-dir)")
    p.add_argument("--draft-dir")
    p.add_argument("--categories", nargs="+", default=["code", "chat", "math", "copy"])
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-ssd", action="store_true", help="leave SSD out (it needs a second device lane)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="ssd_jax's methods (protocol names, e.g. ar sd:4 sd:auto:v32768 ngram:4); default: ar, "
        "sd:K, ngram:K and ssd:K with --k",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny random Qwen2 pair, 2 token-id prompts, 1 repeat"
    )
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)

    import tempfile

    import torch
    import transformers

    import ssd_jax
    from ssd_jax.bench import protocol
    from ssd_jax.decoding.batch import encode_prompts

    torch.set_num_threads(a.threads)
    if a.smoke:
        a.target_dir, a.draft_dir = tiny_pair(Path(tempfile.mkdtemp(prefix="hf_peer_smoke_")))
        a.n_prompts, a.repeats, a.new_tokens, a.k = 2, 1, 8, 2
    if a.target_dir:
        ours_t, ours_d = ssd_jax.load_model(a.target_dir), ssd_jax.load_model(a.draft_dir)
        hf_t, hf_d = hf_models(a.target_dir, a.draft_dir)
    else:
        from ssd_jax.loading import registry

        ours_t = ssd_jax.load_model(a.target, dtype="float32")
        ours_d = ssd_jax.load_model(a.draft, dtype="float32")
        g = [registry.gguf_path(n) for n in (a.target, a.draft)]
        hf_t, hf_d = hf_models((str(g[0].parent), g[0].name), (str(g[1].parent), g[1].name))
    if a.smoke:  # token-id prompts (the tiny models have no tokenizer)
        records = {
            c: [{"id": f"{c}{i}", "prompt": [3 + i, 17, 29, 3 + i, 17, 40 + j]} for i in range(2)]
            for j, c in enumerate(a.categories)
        }
    else:  # chat-templated by our tokenizer, so both engines get the same ids
        records = {}
        for c in a.categories:
            recs = protocol.category_prompts(c, a.n_prompts)
            ids = encode_prompts(ours_t, [r["prompt"] for r in recs], chat=True)
            records[c] = [{"id": r["id"], "prompt": i} for r, i in zip(recs, ids)]
    units = protocol.build_units(records, a.n_prompts, 1)
    methods = a.methods or ["ar", f"sd:{a.k}", f"ngram:{a.k}"] + ([] if a.no_ssd else [f"ssd:{a.k}"])
    runners = {n: protocol.EngineRunner(ours_t, s) for n, s in protocol.method_specs(methods, ours_d).items()}
    runners.update(hf_runners(hf_t, hf_d, a.k))
    env_extra = {
        "target": ours_t.name,
        "draft": ours_d.name,
        "threads": a.threads,
        "peer": "HF transformers",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
        },
    }
    path = protocol.run_protocol(
        runners,
        units,
        a.out,
        repeats=a.repeats,
        new_tokens=a.new_tokens,
        env_extra=env_extra,
        progress=not a.smoke,
    )
    md = protocol.write_report(
        path,
        f"Peer comparison: HF transformers vs ssd_jax ({ours_t.name} / {ours_d.name})",
        bases=("ar", "hf-generate"),
    )
    print(f"wrote {path} and {md}", file=sys.stderr)
    if a.smoke:
        import shutil

        shutil.rmtree(Path(a.target_dir).parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
