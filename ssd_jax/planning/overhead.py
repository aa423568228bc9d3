"""SSD's fixed cost a round, measured where compute is about zero.

A round's wall time on :func:`tiny_model` (2 layers, width 64, a 128-token vocabulary, its own draft:
every proposal accepted, each forward a few microseconds) is what the engine costs beyond its models:
the host's work, the compiled calls and their syncs, the moves between meshes. The planner's stage
costs (:mod:`.calibration`) are wall times of compiled calls, so each already carries one call's
dispatch and sync: SD's round model needs nothing more. An SSD round costs more than the calls it is
priced by (its host bookkeeping, the speculation's hand-over, on two meshes the calls on each side),
and that extra, ``ssd_s − sd_s`` at the same K, is what :mod:`.ssd_model` adds to every SSD round
(:class:`.ssd_model.Overhead`); ``ar_s`` (one compiled call and a host read) prices a fast backup.

The timer runs in the engine's layer (``generate()`` passes it to :func:`.configure.configure` as
``round_timer``): :data:`WARM` untimed runs (they compile), then :data:`REPEATS` timed runs of
:data:`TOKENS` greedy tokens at K = :data:`K` and batch 1 per method, on the run's layout; the
median of the decode time a round. Cached on disk per machine and layout
(:meth:`.records.Calibrator.round_overhead`).
"""

from __future__ import annotations

#: the K the rounds are timed at, greedy tokens a run, timed runs and untimed (compiling) runs per method
K, TOKENS, REPEATS, WARM = 3, 48, 3, 1
#: the prompt's ids (the tiny model has no tokenizer)
PROMPT = (5, 6, 7, 8, 9, 10, 11, 12)


def tiny_model(seed: int = 0):
    """The 2-layer, width-64 random Llama (vocabulary 128, no tokenizer) the engine's costs are measured on."""
    from ssd_jax.loading.loaded import LoadedModel
    from ssd_jax.models.config import ModelConfig
    from ssd_jax.models.params import init_params

    cfg = ModelConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=4096, eos_token_ids=(1,),
    )  # fmt: skip
    return LoadedModel("tiny-2x64", cfg, init_params(cfg, seed, scale=0.15), None, f"seed{seed}", "")
