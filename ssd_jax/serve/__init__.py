"""An OpenAI-compatible server with continuous batching: ``python -m ssd_jax.serve`` (issue 16).

How continuous batching maps onto the engine
--------------------------------------------
The server owns ONE static batch of ``max_batch`` slots of the one engine that ``generate()`` runs:
a target KV cache ``(B, S)`` (and a draft cache for a draft model) with ``S = --max-model-len``
slots per row. A slot holds one sequence (an API request with ``n > 1`` holds ``n`` slots).
One host thread (:class:`~ssd_jax.serve.engine.ServingEngine`, stepping the one engine :class:`ssd_jax.engine.core.Engine` that ``generate()`` also runs) runs rounds:

1. **admit** - between rounds, each waiting sequence takes a free slot. Its prompt is prefilled
   in fixed chunks of ``C = --prefill-chunk`` tokens into that slot's row of the cache (one
   compiled call per chunk, :func:`ssd_jax.decoding.slots.prefill_target`: slice the row out,
   the prefill on it, write it back; a draft model's row likewise). The last chunk
   samples the sequence's first token. Running rows wait at most one chunk per admission.
2. **round** - one compiled call advances the slots (AR and SD on one device: only the first
   ``b`` slots, ``b`` the smallest of ``--batch-buckets`` batch sizes holding every running row,
   reading and writing those rows of the caches in place): AR is ``runtime.ar_slot_round``; SD is
   ``sd.sd_round`` (draft K, verify, rejection-sample, advance) with the model drafter, or with
   n-gram proposals made on the host; SSD is the offline single-device ``rounds.fused_round``
   (verify, rejection-sample, build the speculation tree, look the outcome up, neural backup
   on a miss). Free slots ride along (their results are ignored, their
   cache length is parked at 0).
3. **read** - the round's tokens come to the host; each row's :class:`RowState` (the offline
   engine's detokeniser, EOS / stop / length checks) streams its new text to the request. A
   finished or cancelled (client gone) sequence frees its slot; the slot is reused at step 1.

Nothing recompiles while requests come and go: the shapes are fixed by ``(B, S, C, K)``, and at
start-up the server compiles the admit program and the round program in both of its static
variants (``needs_filter`` False / True: a round uses the filtering one when any running row
asks for top-k / top-p, which leaves the other rows' distributions unchanged), each for every
attention window.

Attention windows (context-length buckets). Attention reads every cache slot of a row, so a
round over ``S = --max-model-len`` slots costs what the longest possible context costs, whatever
the running rows hold: on XLA:CPU an 8-row SmolLM2 decode step at context 200 takes 162 ms over
1024 slots and 86 ms over 256. The server compiles each program for ``--context-buckets``
windows (``S`` halved, :func:`ssd_jax.decoding.slots.context_windows`), and each call attends over
the smallest window holding every running row's context plus the round's writes
(``KVCache.window``, a static field: ``k[:, :W]`` inside the attention; the writes still go to
the full cache). Masked slots beyond a row's length contribute exactly 0 either way, so the
window changes the cost, not the tokens. SSD windows its target cache only (the draft's tree
region lies past the context).

Per-request sampling and seeds
------------------------------
``temperature``, ``top_p`` and ``top_k`` are per row (``RowSampling``, device arrays), and the
verifier is exact per row, so each request's distribution is exact whatever shares its batch. Each
sequence has its own key (from ``seed``; the n-th sample folds in n) and its own round counter, in
the server as offline (the one engine), so a seeded request draws the same tokens whatever its
neighbours and slot. Batch-level choices that could leak between rows are kept out of the draws:
the verifier's acceptance and bonus uniforms come from two streams of the row's key (an n-gram
round that verifies no column draws the same bonus), and SD's draft "catch-up" step is batch-wide
(it rewrites the row's last context token: the same values, so the same tokens up to float rounding
of a 2-token vs 1-token step; the same caveat holds for a 1-column vs a K-column verify).

A seeded request equals offline ``generate`` of that prompt with the same seed, alone or in a
batch: same keys, same steps. Greedy requests equal offline greedy output for AR and SD.

``--k auto`` (the default) is resolved at start-up, as offline (:mod:`ssd_jax.planning`:
measured stage costs and the draft's acceptance, cached on disk), at ``--max-batch`` rows and at every
batch bucket. SD on one device then chooses each round's K from the plan of the round's bucket and the
acceptance seen so far (:class:`~ssd_jax.planning.policy.BucketPlans`), K = 0 (an AR round, the draft
idle and caught up later, :mod:`ssd_jax.decoding.sd_lag`) where no K is expected to pay; the rounds
run per K and bucket are in ``/metrics`` (``spec_decode_num_rounds``). ``--k N`` fixes K.

SSD over HTTP
-------------
``--method ssd`` runs the offline SSD: both models on one device (one compiled call per round), or
with ``--target-devices 1 --draft-devices 1`` the draft on a device of its own (the tree build
overlaps the verify), with any backup (``--backup neural|random|ngram|auto``). Each slot's
speculation (K tokens, and the K draft distributions q) stays on the device between rounds; a
sequence gets its first speculation at admission. Rows draw the tree's tokens, the backup's and the
verifier's uniforms from their own keys, and with more than one slot the fan-out schedule stays at
the estimator's prior rather than adapting to the batch's acceptance, so a seeded SSD request does
not depend on its neighbours (``--backup auto`` is the exception: it chooses the backup per round
from the batch). The server's rounds carry q whatever the rows' temperatures; a greedy row's
verification is argmax matching either way. Cache lookups and hits are counted in ``/metrics``
(``spec_decode_num_cache_lookups`` / ``_hits``).

The host queues round T+1 before reading round T wherever the method allows (not n-gram rounds,
which need round T's tokens), as offline. Under ``python -m ssd_jax.launch --processes 2 ... serve --method ssd
--target-devices N --draft-devices N`` process 0 serves HTTP and process 1 runs the draft, stepping
the same engine (:mod:`ssd_jax.serve.lockstep`).
"""
