"""Speculative speculative decoding (SSD, the Saguaro algorithm), exact at every temperature.

SD leaves the draft idle while the target verifies. In SSD the draft runs on its own
devices and, while the target verifies round T, predicts the likely verification outcomes
of round T and pre-drafts round T+1 for each of them into a speculation cache. When the
outcome arrives, a cache hit hands over the next speculation at once (docs/reference.md §3).

State between rounds, per row (as in SD): both KV caches hold the committed context
(length L), ``cur`` is the last emitted token (in no cache yet), and ``spec`` is the
speculation to verify next: K tokens, how many are real, and - when sampling - the K draft
distributions q they were drawn from (or point masses, for fast fallback proposals).

One round, all compiled static-shape programs:

* target mesh - ``verify``: score ``[cur, s_1..s_K]`` (K+1 positions, one pass), then
  ``sample``: exact rejection sampling (:mod:`ssd_jax.sampling.rejection`) gives the outcome
  (k accepted, bonus token t*) per row.
* draft mesh, dispatched right after the verify without waiting for it - ``build``:
  1. re-run the draft over ``[cur, s_1..s_K]`` (this also writes those K+1 slots of the
     draft cache, which every outcome's committed prefix needs);
  2. at each position k take the top-F_k draft tokens, EXCLUDING s_{k+1} when k < n_draft
     (a rejected proposal has zero residual mass, it cannot be the bonus there) - each
     candidate (k, t) is a branch; the per-row fan-out F is chosen on the host
     (:mod:`.fanout`, geometric per Theorem 12 with a and r estimated online);
  3. decode all batch x B branches for K steps in ONE call (``lax.scan``): branch (k, t)
     attends to the prefix, the first k+1 re-run tokens and its own earlier tokens (a tree
     mask), at RoPE positions L+k+1+d, with its keys/values in a tree region of the draft
     cache past the main slots; Saguaro sampling (below) draws each branch token and its
     distribution is stored with it.
* draft mesh - ``advance``: only the outcome arrays (k, t*, new length per row) cross from
  target to draft. The lookup matches (k, t*) against the branch keys ON DEVICE and
  returns the cached speculation and a hit flag per row. Rows that missed get a fallback
  inside the same call: the neural backup (the draft re-drafts K tokens just in time; a
  ``lax.cond`` skips it when every live row hit) or random tokens (point masses). The
  n-gram fast backup needs the token history, so the host reads the round's tokens, looks
  up every live row and passes the proposals to the lookup call, which uses them where a row
  missed.

Exactness. A cached speculation carries the distributions its tokens were sampled from, so
hits are verified by the ratio rule with the right q; neural fallbacks likewise; fast
fallbacks are point masses (accept with p(x), else resample from p without x). Every rule
is exact for any proposal, so the output follows the target distribution on hits and on
misses, at every temperature (the reference engine is not exact on misses at T > 0).

Saguaro sampling (Definition 14): the draft samples from σ_{F,C}, its filtered distribution
with the probability of its top-F tokens multiplied by C and renormalised (F = the fan-out
of that position). Lowering C pushes the residual max(0, p − σ) onto the cached tokens, so
bonus tokens land in the cache more often, at some cost in acceptance. σ is what the
verifier receives as q, so exactness is untouched. C = 1 is plain sampling.

Backup choice. ``auto`` picks the neural backup below a critical batch size b* and the
n-gram (fast) one above it; b* comes from Corollary 16 (:func:`.fanout.critical_batch_size`)
with the hit rate and the tokens per round after hits and misses observed so far in this run,
and the build, verify and fallback times of a roofline estimate made once before the first
round (:func:`backup_cost_estimate`, reported as ``metrics["backup_model"]``). No clock is
read for the decision, so a seeded run gives the same tokens every time.

Placement. The target lives on a target mesh (tensor parallel), the draft on a disjoint
draft mesh (parameters replicated; the branch axis sharded over its devices, so more draft
devices buy a larger fan-out budget at the same latency). Without ``target_devices`` /
``draft_devices`` both models share one device and run the same algorithm sequentially.

Calls per round (:mod:`.rounds`). With both models on one device the whole round (verify,
rejection sampling, build, lookup and fallback) is ONE compiled call; on two meshes it is one
call on the target mesh and two on the draft mesh (build, then lookup), because the target
needs the next speculation before the next build ends. The host's per-round inputs (fan-out
layouts, live rows) travel in one small control vector, rows pick their layout on the device,
and rounds are queued one ahead of the host's reads; only the n-gram backup makes the host
read a round's tokens before its lookup.

Timing. Only with ``--profile-stages`` or ``--trace FILE``: then the stages run as separate
calls and each is recorded on its device lane (:mod:`ssd_jax.decoding.trace`); an event ends
when its outputs are ready and starts when it was dispatched or when its lane finished the
previous event, whichever is later. ``--trace FILE`` writes them as a Chrome / Perfetto trace;
the overlap of ``build`` with ``verify`` is reported as ``overlap_fraction``. Without them the
stage times are null and ``calls_per_round`` / ``round_s`` are reported.

Layout: :mod:`.tree` (device functions), :mod:`.rounds` (the compiled round programs),
:mod:`.fanout` (schedules and estimators), :mod:`.backup` (backup policy), :mod:`.host` (layouts,
trace lanes, stage times; the round loop is the engine's, :mod:`ssd_jax.engine.methods.ssd`); Saguaro sampling is :mod:`ssd_jax.sampling.saguaro`, placement
:mod:`ssd_jax.parallel.placement`.
"""
