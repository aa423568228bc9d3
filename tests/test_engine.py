"""The one engine (ssd_jax/engine/core.py) driven directly: fewer slots than sequences, sequences arriving
while rounds run, and the seed rule (a seeded row draws the same tokens whatever shares its batch), for
AR, SD and SSD on tiny models."""

import dataclasses

import numpy as np
import pytest
from test_sd import tiny_model

from ssd_jax import SamplingParams, SpecConfig, generate
from ssd_jax.compile import fresh_programs
from ssd_jax.engine.core import Engine, Mode, Sequence
from ssd_jax.engine.methods import build_method
from ssd_jax.errors import UserError

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 3, 5, 7, 2, 9, 4], [20, 21], [5, 5, 5, 5]]
SPECS = {
    "ar": lambda d: SpecConfig(),
    "sd": lambda d: SpecConfig(method="sd", draft=d, k=3, draft_dtype=None, draft_vocab=None),
    "ngram": lambda d: SpecConfig(method="sd", draft="ngram", k=2),
    "ssd": lambda d: SpecConfig(
        method="ssd", draft=d, k=2, backup="neural", draft_dtype=None, draft_vocab=None
    ),
}


@pytest.fixture(scope="module")
def pair():
    return tiny_model(0), tiny_model(1, scale=0.16)


def _engine(pair, spec, sp, slots, batch_buckets=1, **paged):
    target, draft = pair
    method = build_method(target, spec, (Mode.of([sp]),), lambda name: draft)
    return Engine(
        method,
        max_batch=slots,
        max_len=64,
        prefill_chunk=4,
        admit_together=False,
        batch_buckets=batch_buckets,
        **paged,
    )


# SSD with its draft on a device of its own: a round's lookup runs when the next round is dispatched (or
# the round is read, or rows are admitted), so admissions land while a round's lookup is still to run
MESH_SPECS = {
    f"ssd-meshes-{b}": (
        lambda d, b=b: SpecConfig(
            method="ssd",
            draft=d,
            k=2,
            backup=b,
            draft_dtype=None,
            draft_vocab=None,
            target_devices=1,
            draft_devices=1,
        )
    )
    for b in ("neural", "ngram")
}


@pytest.mark.parametrize("method", [*SPECS, *MESH_SPECS])
def test_fewer_slots_than_sequences_and_late_arrivals(pair, method):
    """Five greedy sequences of different lengths through two slots, two of them submitted while rounds
    run: each equals generate() of its prompt alone (AR's tokens)."""
    target, draft = pair
    sp = SamplingParams(max_new_tokens=9, ignore_eos=True)
    alone = [generate(target, [p], sp).outputs[0]["token_ids"] for p in PROMPTS]
    engine = _engine(pair, {**SPECS, **MESH_SPECS}[method](draft), sp, slots=2)
    seqs = [Sequence(p, dataclasses.replace(sp, max_new_tokens=9 - i)) for i, p in enumerate(PROMPTS)]
    engine.submit(seqs[:3])
    for _ in range(3):
        engine.step()
    engine.submit(seqs[3:])
    engine.run()
    assert [s.row.tokens for s in seqs] == [a[: 9 - i] for i, a in enumerate(alone)]
    assert all(s.finish_reason == "length" for s in seqs)
    assert engine.running == 0 and not engine.waiting


def test_ssd_on_meshes_admits_beside_an_open_round_as_if_alone(pair):
    """SSD on two meshes runs a round's lookup when the next round is dispatched: a sequence admitted
    while a round's lookup is still to run gets the draft state it would have alone (sampled, seeded: the
    same tokens whether it arrives late beside two others or first into an empty engine)."""
    _, draft = pair
    spec = MESH_SPECS["ssd-meshes-neural"](draft)
    sp = SamplingParams(temperature=1.0, top_k=20, seed=11, max_new_tokens=8, ignore_eos=True)
    alone = _engine(pair, spec, sp, slots=2)
    solo = Sequence(PROMPTS[3], sp)
    alone.submit([solo])
    alone.run()
    engine = _engine(pair, spec, sp, slots=3)
    first = [Sequence(p, dataclasses.replace(sp, seed=i)) for i, p in enumerate(PROMPTS[:2])]
    engine.submit(first)
    for _ in range(3):
        engine.step()
    late = Sequence(PROMPTS[3], sp)
    engine.submit([late])
    engine.run()
    assert late.row.tokens == solo.row.tokens


# SD and SSD are slow-set here: by default test_serve's 32 concurrent requests check the same rule for them
@pytest.mark.parametrize(
    "method",
    ["ar", "ngram", pytest.param("sd", marks=pytest.mark.slow), pytest.param("ssd", marks=pytest.mark.slow)],
)
def test_a_seeded_row_ignores_its_batch(pair, method):
    """Sampled, seeded: a prompt's samples are the same alone and beside other prompts (each row has its
    own key; offline as in the server)."""
    target, draft = pair
    spec = SPECS[method](draft)
    sp = SamplingParams(temperature=1.0, top_k=20, seed=7, max_new_tokens=6, ignore_eos=True, n=2)
    alone = generate(target, [PROMPTS[2]], sp, spec).outputs
    crowd = generate(target, PROMPTS[:3], sp, spec).outputs[4:6]
    assert [o["token_ids"] for o in crowd] == [o["token_ids"] for o in alone]
    assert alone[0]["token_ids"] != alone[1]["token_ids"]  # the two samples draw from their own streams


# slow-set here (default-suite budget): by default test_serve's servers run buckets over HTTP, the paged and
# server-path tests below run them too, and SSD's run in test_ssd_greedy_rounds_skip_q_and_mixed_batches_stay_exact
@pytest.mark.parametrize(
    "method",
    ["ssd-meshes-ngram"]
    + [pytest.param(m, marks=pytest.mark.slow) for m in ("ssd", "sd", "ar", "ngram", "ssd-meshes-neural")],
)
def test_batch_buckets_run_the_running_rows_only(pair, method):
    """Four slots compiled for 1, 2 and 4 rows: as sequences end, rounds run the smallest bucket holding
    every running row, and each sequence still equals generate() of its prompt alone (AR's tokens); a
    seeded sampled run gives the same tokens with and without buckets (each row's key is its own). SSD
    on two meshes buckets its split rounds too (verify, tree build and lookup over the bucket's rows)."""
    target, draft = pair
    make = {**SPECS, **MESH_SPECS}[method]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    lengths = [12, 3, 5, 9, 2]
    alone = [generate(target, [p], sp).outputs[0]["token_ids"] for p in PROMPTS]
    engine = _engine(pair, make(draft), sp, slots=4, batch_buckets=3)
    assert engine.method.buckets == (1, 2, 4)
    seqs = [Sequence(p, dataclasses.replace(sp, max_new_tokens=n)) for p, n in zip(PROMPTS, lengths)]
    engine.submit(seqs)
    engine.run()
    assert [s.row.tokens for s in seqs] == [a[:n] for a, n in zip(alone, lengths)]
    assert engine.bucket_rounds[1] > 0 and engine.bucket_rounds[4] > 0, engine.bucket_rounds
    # sampled and seeded: the same tokens with and without buckets
    hot = dataclasses.replace(sp, temperature=1.0, top_k=20, seed=5)
    runs = []
    for buckets in (1, 3):
        engine = _engine(pair, make(draft), hot, slots=4, batch_buckets=buckets)
        seqs = [Sequence(p, dataclasses.replace(hot, max_new_tokens=n)) for p, n in zip(PROMPTS, lengths)]
        engine.submit(seqs)
        engine.run()
        runs.append([s.row.tokens for s in seqs])
    assert runs[0] == runs[1]


class ScriptedK:
    """A K policy that plays a fixed schedule (one K per round dispatched), K = 0 among them."""

    alpha, zero = 0.5, True

    def __init__(self, schedule):
        self.schedule, self.i = schedule, 0
        self.ks = tuple(sorted(set(schedule)))
        self.table = np.array(self.ks)

    def k_for(self, bucket, alpha):
        self.i += 1
        return self.schedule[self.i % len(self.schedule)]

    def explore_k(self, bucket, alpha):
        return max(self.ks)

    def ks_at(self, bucket):
        return set(self.ks)


def _acceptance(pair, schedule, buckets):
    target, _ = pair
    sp = SamplingParams(max_new_tokens=14, ignore_eos=True)
    spec = SpecConfig(method="sd", draft=target, k=3, draft_dtype=None, draft_vocab=None)
    spec = dataclasses.replace(spec, k_plan=ScriptedK(schedule))
    engine = _engine((target, target), spec, sp, slots=4, batch_buckets=buckets)
    lengths = [14, 4, 9, 12, 6]
    seqs = [Sequence(p, dataclasses.replace(sp, max_new_tokens=n)) for p, n in zip(PROMPTS, lengths)]
    engine.submit(seqs)
    engine.run()
    alone = [generate(target, [p], sp).outputs[0]["token_ids"] for p in PROMPTS]
    assert [s.row.tokens for s in seqs] == [a[:n] for a, n in zip(alone, lengths)]
    rounds = engine.method.sched.rounds
    assert rounds[0] > 0 and rounds[3] > 0, rounds
    return sum(s.accepted for s in seqs) / sum(s.drafted for s in seqs)


@pytest.mark.parametrize("buckets", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_k_zero_rounds_leave_the_draft_idle_and_catch_it_up(pair, buckets, monkeypatch):
    """K = 0 rounds (AR steps, the draft idle) between speculative ones: greedy output still equals AR's,
    and the draft's cache is caught up before it drafts again. With the target as its own draft every
    proposal is accepted exactly when the draft's cache holds the right tokens; with the catch-up
    disabled (the control) acceptance falls."""
    from ssd_jax.decoding import sd_lag

    schedule = [0, 0, 3, 0, 3, 3, 0, 0, 0, 3, 0, 3]
    assert _acceptance(pair, schedule, buckets) > 0.97
    monkeypatch.setattr(sd_lag, "draft_flush", lambda dparams, dcache, lag, lag_n, **kw: (dcache, lag_n * 0))
    with fresh_programs():  # the disabled catch-up's programs, dropped after
        assert _acceptance(pair, schedule, buckets) < 0.8


SHARED = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # a 20-token "system prompt"


# slow-set (default-suite budget): test_serve's servers run paged caches over HTTP, and test_exactness's
# server-path test asserts prefix hits and preemptions under its statistical test
@pytest.mark.parametrize(
    "method",
    ["ssd", "ssd-meshes-ngram"]
    + [pytest.param(m, marks=pytest.mark.slow) for m in ("sd", "ar", "ngram", "ssd-meshes-neural")],
)
def test_paged_cache_with_prefix_caching_and_preemption(pair, method):
    """A paged cache of 4-slot blocks: prompts sharing a 20-token prefix reuse its cached blocks (hits
    counted), and a pool too small for every slot preempts the newest sequence, which is recomputed and
    continues. Greedy output equals generate() of each prompt alone; a seeded sampled run draws the same
    tokens paged, preempted or not (each row continues at its own step; SSD's with the speculation it had).
    SSD's draft cache is paged too (the target's blocks and ids, its tree in blocks of its own)."""
    target, draft = pair
    make = {**SPECS, **MESH_SPECS}[method]
    prompts = [SHARED + p for p in PROMPTS]
    lengths = [30, 8, 25, 30, 12]
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    alone = [generate(target, [p], sp).outputs[0]["token_ids"] for p in prompts]
    # 3 slots of 64 positions (16 blocks each) over a pool of 17: two rows of 55 tokens (5 shared blocks and
    # 9 of their own each) cannot both grow
    for blocks, must_preempt in ((60, False), (17, True)):
        engine = _engine(pair, make(draft), sp, slots=3, batch_buckets=2, kv_blocks=blocks, block_size=4)
        seqs = [Sequence(p, dataclasses.replace(sp, max_new_tokens=n)) for p, n in zip(prompts, lengths)]
        engine.submit(seqs)
        engine.run()
        assert [s.row.tokens for s in seqs] == [a[:n] for a, n in zip(alone, lengths)], blocks
        pool = engine.pages.pool
        assert pool.hits >= 4 * 4 * 3, (pool.hits, pool.queries)  # later prompts found the shared blocks
        assert (engine.preemptions > 0) == must_preempt, engine.preemptions
        assert pool.n_free == pool.n_blocks and all(s.finish_reason == "length" for s in seqs)
    hot = dataclasses.replace(sp, temperature=1.0, top_k=20, seed=3)
    runs = []
    for paged in ({}, {"kv_blocks": 17, "block_size": 4}):
        engine = _engine(pair, make(draft), hot, slots=3, **paged)
        seqs = [Sequence(p, dataclasses.replace(hot, max_new_tokens=n)) for p, n in zip(prompts, lengths)]
        engine.submit(seqs)
        engine.run()
        runs.append([s.row.tokens for s in seqs])
    assert runs[0] == runs[1]
    assert engine.preemptions > 0


def _window_acceptance(pair, context, **paged):
    """Greedy SD with the target as its own draft, prefill in chunks of 4, the draft seeing only the last
    ``context`` prompt tokens: (output equal to AR's, acceptance)."""
    target, _ = pair
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    spec = SpecConfig(
        method="sd", draft=target, k=3, draft_dtype=None, draft_vocab=None, draft_context=context
    )
    engine = _engine((target, target), spec, sp, slots=2, **paged)
    prompts = [SHARED + p for p in PROMPTS[:3]]
    seqs = [Sequence(p, sp) for p in prompts]
    engine.submit(seqs)
    engine.run()
    alone = [generate(target, [p], sp).outputs[0]["token_ids"] for p in prompts]
    assert [s.row.tokens for s in seqs] == alone
    return sum(s.accepted for s in seqs) / sum(s.drafted for s in seqs)


def test_draft_context_window_is_exact_and_hides_the_prompt(pair):
    """``draft_context``: the draft prefills and sees only the chunks holding the last W prompt tokens. Greedy
    output equals AR's whatever W; the target as its own draft accepts everything with a window wider than
    the prompts (nothing hidden) and less with W = 2 (a 4-token chunk of a 25-token prompt: the control
    that shows the window is applied), also over a paged cache."""
    assert _window_acceptance(pair, 64) > 0.97
    assert _window_acceptance(pair, 2) < 0.9
    assert _window_acceptance(pair, 2, kv_blocks=40, block_size=4) < 0.9
    with pytest.raises(UserError, match="draft-context"):
        SpecConfig(method="sd", draft="ngram", draft_context=8).validate()
    with pytest.raises(UserError, match="draft-context"):
        SpecConfig(method="sd", draft="x", draft_context=0).validate()
    with pytest.raises(UserError, match="draft-context"):
        SpecConfig(method="sd", draft="x", draft_context=8, draft_devices=1).validate()


def test_ssd_greedy_rounds_skip_q_and_mixed_batches_stay_exact(pair):
    """SSD on one device builds a round's tree without the draft's q when every live row is greedy (the
    speculations keep their q for rows that sample later). Greedy rows beside a sampled one still equal
    AR, and the seeded sampled row draws the same tokens as alone (batch buckets on)."""
    target, draft = pair
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    hot = SamplingParams(temperature=1.0, top_k=20, seed=3, max_new_tokens=8, ignore_eos=True)
    spec = SPECS["ssd"](draft)

    method = build_method(target, spec, (Mode.of([greedy]), Mode.of([hot])), lambda name: draft)
    engine = Engine(method, max_batch=4, max_len=64, prefill_chunk=4, admit_together=False, batch_buckets=2)

    def run(items):  # one engine: its programs compiled once (buckets 2 and 4)
        seqs = [Sequence(p, sp) for p, sp in items]
        engine.submit(seqs)
        engine.run()
        return [s.row.tokens for s in seqs]

    alone = run([(PROMPTS[1], hot)])[0]
    mixed = run([(PROMPTS[0], greedy), (PROMPTS[1], hot), (PROMPTS[2], greedy)])
    ar = [generate(target, [p], greedy).outputs[0]["token_ids"] for p in (PROMPTS[0], PROMPTS[2])]
    assert [mixed[0], mixed[2]] == ar and mixed[1] == alone


def _ssd_switching(pair, draft, zero=(4,), spec="ssd"):
    """Greedy SSD over 4 slots (buckets 1, 2, 4) with AR rounds at the ``zero`` buckets: (each row's
    tokens, AR's, the rounds by K, the acceptance of the speculative rounds)."""
    from ssd_jax.planning.policy import BucketSwitch

    target, _ = pair
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    spec = dataclasses.replace({**SPECS, **MESH_SPECS}[spec](draft), k_plan=BucketSwitch(2, 1.0, zero=zero))
    engine = _engine(pair, spec, sp, slots=4, batch_buckets=3)
    lengths = [24, 16, 10, 6, 12]
    seqs = [Sequence(p, dataclasses.replace(sp, max_new_tokens=n)) for p, n in zip(PROMPTS, lengths)]
    engine.submit(seqs[:4])
    for _ in range(12):  # AR rounds while 3-4 rows run, SSD rounds at 1-2, then a late arrival: AR again
        engine.step()
    engine.submit(seqs[4:])
    engine.run()
    ar = [generate(target, [p], sp).outputs[0]["token_ids"][:n] for p, n in zip(PROMPTS, lengths)]
    acc = sum(s.accepted for s in seqs) / max(1, sum(s.drafted for s in seqs))
    return [s.row.tokens for s in seqs], ar, dict(engine.method.k_rounds), acc


@pytest.mark.parametrize(
    "spec", ["ssd", "ssd-meshes-ngram", pytest.param("ssd-meshes-neural", marks=pytest.mark.slow)]
)
def test_ssd_switches_to_ar_rounds_by_bucket_and_catches_its_draft_up(pair, spec):
    """SSD's K auto in a server runs AR rounds (K = 0) at the buckets where its round cannot pay
    (``BucketSwitch``, here fixed: bucket 4), on one device and on two meshes (where the target's AR
    rounds run without the draft and what they emitted crosses to it before SSD's next round).
    Switching back and forth, greedy output equals AR's; with the target as its own draft every
    proposal is accepted exactly when the catch-up (the idle draft's missed tokens, then a fresh
    speculation) is right."""
    target, draft = pair
    got, ar, k_rounds, acc = _ssd_switching(pair, target, spec=spec)
    assert got == ar and k_rounds[0] > 0 and k_rounds[2] > 0 and acc > 0.97, (k_rounds, acc)


@pytest.mark.slow  # default-suite budget
def test_ssd_switching_without_the_catch_up_loses_acceptance(pair, monkeypatch):
    """The control of the test above: with the flush disabled, output still equals AR's (exact either
    way) but acceptance falls."""
    from ssd_jax.compile import fresh_programs
    from ssd_jax.decoding import sd_lag

    target, _ = pair
    monkeypatch.setattr(sd_lag, "draft_flush", lambda dparams, dcache, lag, lag_n, **kw: (dcache, lag_n * 0))
    with fresh_programs():  # the rounds built with the patched flush, dropped after
        got, ar, _, acc = _ssd_switching(pair, target)
    assert got == ar and acc < 0.8, acc


@pytest.mark.slow
def test_ssd_with_ar_rounds_at_every_bucket_leaves_its_draft_out(pair):
    """Where no bucket speculates, SSD serves AR rounds only and skips the draft (admission too): greedy
    output still equals AR's."""
    got, ar, k_rounds, _ = _ssd_switching(pair, pair[1], zero=(1, 2, 4))
    assert got == ar and k_rounds[0] > 0 and k_rounds[2] == 0, k_rounds
