"""Self-distillation data: the target's own answers and its top-k distributions, cached on disk.

``python -m ssd_jax.train distill-data --target NAME --out DIR`` (:func:`build_distill_data`):

1. **Prompts.** :func:`ssd_jax.data.training_prompts`: HumanEval, MT-bench, ShareGPT and CHAMP,
   training split only, never a prompt a benchmark may use; the sources in turn, so any prefix
   is balanced. Each prompt is cut to ``max_prompt_tokens`` tokens and wrapped as one user turn
   in the target's chat template (``chat``; raw text if the tokenizer has no template).
2. **Continuations and top-k, in one pass.** For each temperature, the shard's prompts are sorted by
   length (stable) and cut into batches of ``batch_size``; each batch is one device call
   (:func:`answer_program`): the prefill, then up to ``max_new_tokens`` decode steps in a
   ``while_loop`` that stops once every row has emitted an EOS (kept). Each token is drawn exactly as
   :func:`ssd_jax.engine.generate` draws it, and stored with the ``top_k`` token ids and
   log-probabilities of the same logits at temperature 1 (whatever temperature sampled the token), so
   no second, teacher-forced pass over prompt + continuation is needed. The stored log-probabilities
   are the real ones (not renormalised): ``1 - sum(exp)`` is the tail mass the training loss uses.
   The seed of each batch is a pure function of (recipe seed, temperature index, shard, batch), so a
   regenerated shard is the same.
3. **Static shapes.** A batch's prompts are right-padded to a multiple of 64 tokens (the width) and
   its KV cache holds width + ``max_new_tokens`` slots; a short last batch is filled up with rows
   that are never read. Sorted batches need little padding, and a whole run compiles one program per
   width, at most ``ceil((chat template + max_prompt_tokens) / 64)`` of them, each once per process
   (the summary and each shard's ``timing`` count them). Before (``generation`` 1 in the recipe),
   batches in prompt order were padded to a power-of-two width of their longest prompt and then
   scored by a second forward pass: about 80% of the prefill was padding.

Storage (``DIR``)::

    manifest.json                   the recipe, the target (name, weights sha256, tokenizer), prompt ids
    shard-t<i>-<nnnnn>.npz          ``shard_prompts`` prompts at temperature i: tokens, offsets,
                                    prompt lengths, top-k ids (int32) and log-probs (float32), meta

Every file is written to a temporary name, fsynced and renamed into place, so a kill leaves only
complete shards; a rerun with the same recipe skips them (resume) and regenerates the rest. The
prompt list is a prefix-stable function of the recipe, so a rerun with a larger ``n_prompts`` and
everything else equal keeps the complete shards too. Any other change of the recipe or of the
target is refused with a one-line error. The recipe key excludes nothing else: batch size and
shard size change the sampled tokens at T > 0, so they are part of it, and so is ``generation`` (how
batches are formed; data of generation 1 still load for training, but are not resumed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.data.prompts import TRAINING_SOURCES, training_prompts
from ssd_jax.errors import UserError

MANIFEST = "manifest.json"
FORMAT = "ssd_jax.distill"
FORMAT_VERSION = 1
_WIDTH = 64  # prompt widths are multiples of this: with length-sorted batches, a few compiled shapes
# how continuations and top-k are made, part of the recipe key: 2 = length-sorted batches, the top-k
# taken from the generation's own logits (1, before it: prompt order and a teacher-forced pass)
GENERATION = 2


@dataclasses.dataclass(frozen=True)
class DistillRecipe:
    """Everything the distillation data depend on (the ``distill-data`` flags).

    Attributes:
      target: registry name or path of the target.
      n_prompts: prompts (the first of :func:`ssd_jax.data.training_prompts`).
      temperatures: one continuation per prompt at each temperature (0 = greedy).
      top_k: target tokens stored per generated position.
      max_new_tokens, max_prompt_tokens: continuation budget; prompt cut (in tokens, before the
        chat template).
      sources: prompt sources.
      seed: prompt order and sampling seed.
      chat: wrap prompts in the target's chat template.
      batch_size: generation batch (a shard's prompts are sorted by length first).
      shard_prompts: prompts per shard file (the unit of resume).
    """

    target: str
    n_prompts: int = 256
    temperatures: tuple[float, ...] = (0.0, 1.0)
    top_k: int = 32
    max_new_tokens: int = 128
    max_prompt_tokens: int = 384
    sources: tuple[str, ...] = TRAINING_SOURCES
    seed: int = 0
    chat: bool = True
    batch_size: int = 16
    shard_prompts: int = 64

    def check(self) -> None:
        if self.n_prompts < 1 or self.top_k < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise UserError("--n-prompts, --top-k, --max-new-tokens and --max-prompt-tokens must be >= 1")
        if not self.temperatures or any(not (t >= 0 and np.isfinite(t)) for t in self.temperatures):
            raise UserError(f"--temperatures must be finite and >= 0, got {list(self.temperatures)}")
        if self.batch_size < 1 or self.shard_prompts < 1:
            raise UserError("--batch-size and --shard-prompts must be >= 1")

    def key(self) -> dict[str, Any]:
        """The recipe as JSON without the target name and ``n_prompts`` (which may grow on resume)."""
        d = dataclasses.asdict(self)
        d.pop("target")
        d.pop("n_prompts")
        d["temperatures"] = [float(t) for t in self.temperatures]
        d["sources"] = list(self.sources)
        d["generation"] = GENERATION
        return d


# --- files ----------------------------------------------------------------------------------
def write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file, fsync and rename (readers see all or nothing)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)
    finally:
        tmp.unlink(missing_ok=True)


def shard_bytes(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> bytes:
    """An ``.npz`` (stored, not compressed) of ``arrays`` plus a ``meta`` JSON member."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for name, a in {**arrays, "meta": np.asarray(json.dumps(meta, sort_keys=True))}.items():
            b = io.BytesIO()
            np.lib.format.write_array(
                b, np.asarray(a), allow_pickle=False
            )  # (ascontiguousarray makes 0-d 1-d)
            z.writestr(zipfile.ZipInfo(f"{name}.npy", (1980, 1, 1, 0, 0, 0)), b.getvalue())
    return buf.getvalue()


SHARD_ARRAYS = ("tokens", "offsets", "prompt_lens", "topk_ids", "topk_logprobs")


def read_shard(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """(arrays, meta) of a shard file, or None if it is missing or unreadable."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {k: np.asarray(z[k]) for k in SHARD_ARRAYS}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    return arrays, meta


def shard_name(t_index: int, shard: int) -> str:
    return f"shard-t{t_index}-{shard:05d}.npz"


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _recipe_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    return "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    f = Path(path) / MANIFEST
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not distillation data (cannot read {MANIFEST}: {e})") from None
    if (
        not isinstance(meta, dict)
        or meta.get("format") != FORMAT
        or meta.get("format_version") != FORMAT_VERSION
    ):
        raise UserError(f"{path}: {MANIFEST} is not a {FORMAT} v{FORMAT_VERSION} manifest")
    return meta


def is_distill_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).is_file()


# --- prompts and the generation ---------------------------------------------------------------
def encode_prompt(tokenizer, text: str, max_tokens: int, chat: bool) -> list[int]:
    """``text`` cut to ``max_tokens`` tokens, then (``chat``) wrapped as one user turn."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > max_tokens:
        text = tokenizer.decode(ids[:max_tokens], skip_special_tokens=False)
    if chat and tokenizer.chat_template:
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return tokenizer.encode(templated, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=True)[: max_tokens + 1]


_PROGRAMS: dict[Any, Any] = {}


def answer_program(cfg, k: int, n_new: int, eos: tuple[int, ...]):
    """The compiled ``(params, tokens_BxW, n_valid_B, live_B, key, rs) -> (tokens_BxN, logprobs_BxNxK,
    ids_BxNxK)``: prefill, then up to ``n_new`` one-token steps in one device call (a
    ``while_loop`` that stops when every live row has emitted an EOS). Token ``j`` of a row is drawn
    exactly as :func:`ssd_jax.engine.generate` draws it (prefill with ``key``, step ``j`` with
    ``fold_in(key, j)``) and stored with the top-k of the same logits at temperature 1, so no second,
    teacher-forced pass is needed. Rows keep decoding after their EOS (the host cuts them there);
    ``live_B = False`` marks filler rows of a short last batch. One program per prompt width W (the
    cache holds ``W + n_new`` slots), counted by :class:`ssd_jax.compile.Compiled`."""
    spec = (cfg, k, n_new, eos)
    if spec in _PROGRAMS:
        return _PROGRAMS[spec]
    import jax
    import jax.numpy as jnp

    from ssd_jax.compile import Compiled
    from ssd_jax.models import llama
    from ssd_jax.sampling.filters import sample

    eos_E = np.asarray(eos, np.int32)

    def answer(params, tokens_BxW, n_valid_B, live_B, key, rs):
        B, W = tokens_BxW.shape

        def pick(key_t, h_BxD):
            lg = llama.logits(params, cfg, h_BxD)
            lp, ids = jax.lax.top_k(jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1), k)
            return sample(key_t, lg, rs, False), lp, ids.astype(jnp.int32)

        h, cache = llama.forward(params, cfg, tokens_BxW, llama.init_cache(cfg, B, W + n_new))
        tok, lp, ids = pick(key, jnp.take_along_axis(h, (n_valid_B - 1)[:, None, None], axis=1)[:, 0])
        out = (
            jnp.zeros((B, n_new), jnp.int32).at[:, 0].set(tok),
            jnp.zeros((B, n_new, k), jnp.float32).at[:, 0].set(lp),
            jnp.zeros((B, n_new, k), jnp.int32).at[:, 0].set(ids),
        )
        done = ~live_B | jnp.isin(tok, eos_E)

        def more(c):
            return (c[0] < n_new) & ~jnp.all(c[2])

        def step(c):
            t, cache, done, tok, out = c
            h, cache = llama.forward(params, cfg, tok[:, None], cache)
            tok, lp, ids = pick(jax.random.fold_in(key, t), h[:, 0])
            out = tuple(o.at[:, t].set(x) for o, x in zip(out, (tok, lp, ids)))
            return t + 1, cache.with_lengths(cache.lengths + 1), done | jnp.isin(tok, eos_E), tok, out

        c = (jnp.int32(1), cache.with_lengths(n_valid_B), done, tok, out)
        return jax.lax.while_loop(more, step, c)[-1]

    _PROGRAMS[spec] = Compiled(answer, name="distill-answer")
    return _PROGRAMS[spec]


def prompt_width(n: int) -> int:
    """The prefill width of a batch whose longest prompt has ``n`` tokens: a multiple of ``_WIDTH``."""
    return max(_WIDTH, -(-n // _WIDTH) * _WIDTH)


def answer_batch(target, prompts: list[list[int]], temperature: float, seed: int, recipe: DistillRecipe, eos):
    """Continuations of ``prompts`` (at most ``batch_size``, padded to it with filler rows) with the
    top-k of every generated position: one ``(continuation, finish reason, logprobs (n, k), ids (n, k))``
    per prompt; a continuation ends at its first EOS (kept) or after ``max_new_tokens`` (``eos``: sorted ids)."""
    import jax

    from ssd_jax.decoding.batch import seed_key
    from ssd_jax.sampling.filters import RowSampling, SamplingParams

    B, N = recipe.batch_size, recipe.max_new_tokens
    W = prompt_width(max(len(p) for p in prompts))
    tokens = np.zeros((B, W), np.int32)
    n_valid = np.ones(B, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)], n_valid[b] = p, len(p)
    live = np.arange(B) < len(prompts)
    prog = answer_program(target.cfg, recipe.top_k, N, eos)
    rs = RowSampling.broadcast(SamplingParams(temperature=temperature), B)
    key = seed_key(seed, jax.device_put)
    out_tok, out_lp, out_ids = jax.device_get(prog(target.params, tokens, n_valid, live, key, rs))
    rows = []
    for b in range(len(prompts)):
        hit = np.flatnonzero(np.isin(out_tok[b], eos))
        n = int(hit[0]) + 1 if len(hit) else N
        rows.append((out_tok[b, :n].tolist(), "eos" if len(hit) else "length", out_lp[b, :n], out_ids[b, :n]))
    return rows


# --- building ---------------------------------------------------------------------------------
def _log(msg: str) -> None:
    import sys

    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def build_distill_data(
    recipe: DistillRecipe,
    out: str | os.PathLike,
    *,
    target=None,
    prompts: list[dict] | None = None,
    on_shard=None,
) -> dict[str, Any]:
    """Generate (or resume) the distillation data in ``out``; returns a summary with timings.

    ``target`` (a loaded model) and ``prompts`` (records with ``id`` and ``prompt``) override
    loading the target and :func:`training_prompts` (tests); ``on_shard(name)`` is called after
    each shard is written (tests use it to interrupt a run).
    """
    from ssd_jax.decoding.batch import eos_ids
    from ssd_jax.loading import load_model
    from ssd_jax.loading.store import progress

    recipe.check()
    out = Path(out)
    target = target or load_model(recipe.target)
    tok = target.tokenizer
    if tok is None:
        raise UserError(f"target {recipe.target} has no tokenizer: cannot build distillation prompts")
    if prompts is None:
        prompts = training_prompts(recipe.sources, n=recipe.n_prompts, seed=recipe.seed)
    prompts = list(prompts)[: recipe.n_prompts]
    if not prompts:
        raise UserError("no training prompts to distill")
    ids = [str(r["id"]) for r in prompts]
    manifest = _open_out(out, recipe, target, ids)

    key_sha = _sha({"recipe": manifest["recipe"], "target": target.weights_sha256})
    S = recipe.shard_prompts
    n_shards = -(-len(prompts) // S)
    jobs = [(ti, t, s) for ti, t in enumerate(recipe.temperatures) for s in range(n_shards)]
    eos = tuple(sorted(eos_ids(target)))
    prog = answer_program(target.cfg, recipe.top_k, recipe.max_new_tokens, eos)
    stats = {"shards_written": 0, "shards_kept": 0, "gen_tokens": 0, "gen_s": 0.0,
             "compiles": 0, "compile_s": 0.0}  # fmt: skip
    bar = progress(total=len(jobs), desc="distill-data", unit="shard", leave=True, mininterval=1.0)
    try:
        for ti, temp, s in jobs:
            name = shard_name(ti, s)
            shard_ids = ids[s * S : (s + 1) * S]
            got = read_shard(out / name)
            if got is not None and got[1].get("key") == key_sha and got[1].get("prompt_ids") == shard_ids:
                stats["shards_kept"] += 1
                bar.update(1)
                continue
            recs = prompts[s * S : (s + 1) * S]
            p_ids = [encode_prompt(tok, r["prompt"], recipe.max_prompt_tokens, recipe.chat) for r in recs]
            answers, timing = _answer_shard(
                target, recipe, prog, eos, p_ids, float(temp), (ti, s), bar, stats
            )
            for k in timing:
                stats[k] += timing[k]
            meta = {
                "key": key_sha,
                "temperature": float(temp),
                "shard": s,
                "prompt_ids": shard_ids,
                "finish_reasons": [a[1] for a in answers],
                "timing": timing,
            }  # timing includes compilation
            write_atomic(out / name, shard_bytes(_shard_arrays(p_ids, answers), meta))
            stats["shards_written"] += 1
            bar.update(1)
            if on_shard is not None:
                on_shard(name)
    finally:
        bar.close()
    stats["tokens_per_s"] = stats["gen_tokens"] / stats["gen_s"] if stats["gen_s"] else None
    return {"out": str(out), "shards": len(jobs), **stats}


def _open_out(out: Path, recipe: DistillRecipe, target, ids: list[str]) -> dict[str, Any]:
    """Makes ``out`` this run's and returns its manifest: data of another recipe or target, or whose prompt
    list ``ids`` does not extend, is refused in one line; temporary files of a killed run are removed and
    the manifest is (re)written."""
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "recipe": recipe.key(),
        "n_prompts": len(ids),
        "target": {
            "name": recipe.target,
            "weights_sha256": target.weights_sha256,
            "tokenizer_fingerprint": target.tokenizer.fingerprint(),
        },
        "prompt_ids": ids,
    }
    if is_distill_dir(out):
        old = read_manifest(out)
        diff = _recipe_diff(old.get("recipe", {}), manifest["recipe"])
        if old.get("target", {}).get("weights_sha256") != target.weights_sha256:
            diff = "; ".join(x for x in (diff, f"target weights {recipe.target}") if x)
        if (
            not diff
            and old.get("prompt_ids", [])[: min(len(old["prompt_ids"]), len(ids))]
            != ids[: len(old["prompt_ids"])]
        ):
            diff = "prompt list (not a prefix of the stored one)"
        if diff:
            raise UserError(
                f"{out} holds distillation data of a different recipe ({diff}); use another --out or delete it"
            )
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob(".*.tmp-*"):  # temporary files of a killed run
        p.unlink(missing_ok=True)
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def _answer_shard(target, recipe: DistillRecipe, prog, eos, p_ids, temp: float, where, bar, stats):
    """The answers to one shard's prompts ``p_ids`` (in their order; ``where``: the shard's (temperature
    index, number), which seeds its batches) and the shard's timing (compilation included). ``stats``,
    the run's totals before this shard, only feed the progress bar's rate."""
    ti, s = where
    longest = max(len(p) for p in p_ids)
    if longest + recipe.max_new_tokens > target.cfg.max_position_embeddings:
        raise UserError(
            f"a prompt of {longest} tokens + --max-new-tokens {recipe.max_new_tokens} exceeds the "
            f"context window of {recipe.target} ({target.cfg.max_position_embeddings} tokens)"
        )
    # batches of similar lengths (stable sort): little prefill padding, and a few prompt widths
    # over the whole run, each compiled once
    order = sorted(range(len(p_ids)), key=lambda i: len(p_ids[i]))
    answers = [None] * len(p_ids)  # (continuation, finish reason, top-k log-probs, top-k ids)
    timing = {"gen_s": 0.0, "gen_tokens": 0, "compiles": 0, "compile_s": 0.0}
    B = recipe.batch_size
    for b in range(0, len(order), B):
        rows = order[b : b + B]
        seed = int(np.random.SeedSequence([recipe.seed, ti, s, b]).generate_state(1)[0] >> 1)
        c0, cs0, t0 = prog.compiles, prog.compile_s, time.perf_counter()
        for i, a in zip(rows, answer_batch(target, [p_ids[i] for i in rows], temp, seed, recipe, eos)):
            answers[i] = a
            timing["gen_tokens"] += len(a[0])
        timing["gen_s"] += time.perf_counter() - t0
        timing["compiles"] += prog.compiles - c0
        timing["compile_s"] += prog.compile_s - cs0
        done = {k: stats[k] + timing[k] for k in ("gen_tokens", "gen_s")}
        bar.set_postfix_str(f"{done['gen_tokens'] / max(done['gen_s'], 1e-9):,.0f} tok/s", refresh=False)
    return answers, timing


def _shard_arrays(p_ids: list[list[int]], answers) -> dict[str, np.ndarray]:
    """A shard's arrays: the sequences (prompt + continuation) concatenated, their offsets, the prompt
    lengths and the generated positions' top-k ids and log-probabilities."""
    seqs = [list(p) + a[0] for p, a in zip(p_ids, answers)]
    return {
        "tokens": np.concatenate([np.asarray(q, np.int32) for q in seqs]),
        "offsets": np.concatenate([[0], np.cumsum([len(q) for q in seqs])]).astype(np.int64),
        "prompt_lens": np.asarray([len(p) for p in p_ids], np.int32),
        "topk_ids": np.concatenate([a[3] for a in answers]),
        "topk_logprobs": np.concatenate([a[2] for a in answers]),
    }


# --- reading -----------------------------------------------------------------------------------
@dataclasses.dataclass
class DistillData:
    """All shards of a distillation directory, concatenated (sequence ``i`` is
    ``tokens[offsets[i]:offsets[i+1]]``; its generated positions' top-k rows start at
    ``gen_offsets[i]``)."""

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    gen_offsets: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    info: dict[str, Any]
    cache: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)  # derived plans (packing)

    @property
    def n(self) -> int:
        return len(self.prompt_lens)


def load_distill_data(path: str | os.PathLike, weights_sha256: str | None = None) -> DistillData:
    """Read every shard the manifest calls for; refuses incomplete data and a different target."""
    path = Path(path)
    man = read_manifest(path)
    if weights_sha256 is not None and man["target"].get("weights_sha256") != weights_sha256:
        raise UserError(
            f"distillation data {path} was made with another target ({man['target'].get('name')}); "
            f"train against that target or rebuild the data"
        )
    rec = man["recipe"]
    n_shards = -(-man["n_prompts"] // rec["shard_prompts"])
    parts, missing = [], []
    for ti in range(len(rec["temperatures"])):
        for s in range(n_shards):
            got = read_shard(path / shard_name(ti, s))
            (parts.append(got[0]) if got is not None else missing.append(shard_name(ti, s)))
    if missing:
        raise UserError(
            f"distillation data {path} is incomplete ({len(missing)} shards missing, e.g. {missing[0]}): "
            f"rerun distill-data with the same recipe to finish it"
        )
    tokens, offsets, plens, tids, tlps = [], [0], [], [], []
    for a in parts:
        offsets += list(offsets[-1] + a["offsets"][1:])
        tokens.append(a["tokens"])
        plens.append(a["prompt_lens"])
        tids.append(a["topk_ids"])
        tlps.append(a["topk_logprobs"])
    offsets = np.asarray(offsets, np.int64)
    plens = np.concatenate(plens).astype(np.int64)
    glens = np.diff(offsets) - plens
    data = DistillData(
        tokens=np.concatenate(tokens),
        offsets=offsets,
        prompt_lens=plens,
        gen_offsets=np.concatenate([[0], np.cumsum(glens)]).astype(np.int64),
        topk_ids=np.concatenate(tids),
        topk_logprobs=np.concatenate(tlps),
        info={},
    )
    h = hashlib.sha256()
    for a in (data.tokens, data.offsets, data.topk_ids, data.topk_logprobs):
        h.update(np.ascontiguousarray(a).tobytes())
    data.info = {
        "data": str(path),
        "recipe": rec,
        "sequences": data.n,
        "tokens": int(len(data.tokens)),
        "generated_tokens": int(glens.sum()),
        "sha256": h.hexdigest(),
        "top_k": rec["top_k"],
    }
    return data
