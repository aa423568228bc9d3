"""Draft training: ``python -m ssd_jax.train --target NAME_OR_PATH --size auto``.

Trains a draft model for speculative decoding against a given target, sized by the SDSL
scaling law (:mod:`ssd_jax.analysis.sdsl`), and writes resumable orbax checkpoints that load anywhere a
draft is accepted (``--draft checkpoints/<name>``).

Architecture and sizing
-----------------------
The draft shares the target's tokenizer AND its embedding table (and output head when the
target's is untied): it has the target's width, heads and FFN width, and only its depth is
chosen. The shared tensors are frozen during training and not stored with the draft, so
a draft of a 135M target stores ≈10M parameters (≈42 MB in float32) instead of carrying its
own 28M-parameter (49152 × 576) embedding. Sharing also pins the width: with the width fixed,
the parameter budget N sets the number of layers (``round(N / params per layer)``, at least 1).

Parameter counts, the convention used: the law's target size M is the target's TOTAL
parameter count with tied embeddings counted once (as :mod:`ssd_jax.analysis.sdsl` documents: the
convention of the model sizes the paper fits). The draft's N is the count of parameters it
adds to the shared embedding: its layers and final norm, i.e. its NON-embedding count.
Counting the shared embedding in N is not possible at this scale: for SmolLM2-135M the law
gives N_opt ≈ 10.9M, smaller than the 28.3M shared embedding alone. Note what this means for
the law's cost model (weight reads per token): the draft's tied output head still reads the
whole V × D table every step, so its real per-token cost is ``N + V·D`` (SmolLM2: ≈39M, 29%
of the target), which the checkpoint metadata records next to N (``params.reads_per_token``).

Initialisation: layers are copied from the target (``--init-layers``: ``spread`` picks evenly
spaced target layers including the first and last, ``first`` the first ones, ``none`` a
random init, or an explicit list such as ``0,15,29``); the final norm is the target's.

Data, loss, optimiser
---------------------
Real text (:mod:`ssd_jax.data`): ShareGPT conversations rendered with the target's chat
template, plus HumanEval, MT-bench and CHAMP texts, tokenized with the target's tokenizer
into one stream per split (documents separated by EOS; the held-out split is the data
module's fixed ~5%; evaluation takes at most two windows from each held-out document, so it
spans many of them). ``--data FILE`` uses a .txt (documents split on blank lines) or .jsonl
(``"text"`` field) file instead. Training windows of ``seq_len + 1`` tokens are drawn from
the stream in an order that is a pure function of (seed, step): window ``step·B + b`` comes
from a per-epoch permutation seeded by (seed, epoch), so a resumed run sees the same data.

Self-distillation (:mod:`ssd_jax.training.distill_data`, :mod:`ssd_jax.training.distill`):
``python -m ssd_jax.train distill-data`` stores the target's own answers to training prompts
(T = 0 and 1; length-sorted batches, each one device call that also keeps the top-k of the
logits it samples from) with its top-k log-probabilities at every generated position, in
resumable atomic shards; ``--loss distill --data DIR`` (``--pack``: several sequences per
window, each attending to itself only) then trains on
them without running the target: KL to the stored top-k (the tail as one extra outcome, or the
top-k renormalised: ``--distill-tail``), mixed with CE on the stored tokens by ``--ce-weight``,
optionally through a head trimmed to ``--draft-vocab N`` tokens.

Losses: ``ce`` next-token cross-entropy; ``kl`` forward KL(p_target || q_draft) at
temperature 1 against the target's logits computed on the fly (distillation; minimising it
raises the acceptance α = Σ min(p, q) = 1 − TV(p, q)); ``mix`` their mean. optax AdamW
(β = 0.9, 0.95; no decay on norms) with linear warmup + cosine decay to 10% and global-norm
clipping. One jitted ``train_step(params, opt_state, batch, frozen) -> (params, opt_state,
metrics)`` per step; ``frozen`` holds the shared tensors and the teacher's parameters (never
donated, never updated).

Evaluation (every ``--eval-every`` steps and at step 0, on fixed held-out windows): the
draft's perplexity, the target's, the KL, the acceptance α = E_t Σ_x min(p, q) at temperature
1 and the greedy match rate P(argmax q = argmax p), from the two distributions directly.

Checkpoints: see :mod:`ssd_jax.loading.draft` for the layout. ``--resume`` restores the
newest complete step (orbax finalises a step by renaming it into place, so a kill -9 during
a save leaves the previous step intact), cuts the log and eval history back to it, and
continues with the same data order: the result is bit-identical to an uninterrupted run.
A NaN/inf loss stops training without saving, keeping the last good checkpoint.

Modules
-------
``args`` (:class:`TrainArgs`, the run's settings), ``draft_model`` (sizing by SDSL and
initialisation from the target), ``corpus`` (token streams and the data order), ``objective``
(forward pass, losses, optimiser, jitted train / eval steps), ``checkpoint`` (the run
directory: orbax states, log, best export), ``distill_data`` (the self-distillation data cache),
``distill`` (its batches, loss and train step), ``loop`` (:func:`train`). The CLI is
:mod:`ssd_jax.cli.train`. This package face re-exports the public names.
"""

from ssd_jax.training.args import INIT_MODES, LOSSES, TrainArgs, eval_batch_count, parse_size
from ssd_jax.training.checkpoint import RunDir, tensors_sha256
from ssd_jax.training.corpus import Corpus, build_corpus, corpus_docs, eval_batches, token_stream, train_batch
from ssd_jax.training.distill_data import DistillData, DistillRecipe, build_distill_data, load_distill_data
from ssd_jax.training.draft_model import (
    init_layer_indices,
    init_trained,
    layer_param_count,
    param_report,
    shared_names,
    size_draft,
)
from ssd_jax.training.loop import train
from ssd_jax.training.objective import (
    causal_logits,
    evaluate,
    make_eval_step,
    make_optimizer,
    make_train_step,
    token_stats,
)

__all__ = [
    "INIT_MODES",
    "LOSSES",
    "Corpus",
    "DistillData",
    "DistillRecipe",
    "RunDir",
    "TrainArgs",
    "build_corpus",
    "build_distill_data",
    "causal_logits",
    "corpus_docs",
    "eval_batch_count",
    "eval_batches",
    "evaluate",
    "init_layer_indices",
    "init_trained",
    "layer_param_count",
    "load_distill_data",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "param_report",
    "parse_size",
    "shared_names",
    "size_draft",
    "tensors_sha256",
    "token_stats",
    "token_stream",
    "train",
    "train_batch",
]
