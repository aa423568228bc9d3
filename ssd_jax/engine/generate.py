"""``generate()``: the offline front of the one engine (:mod:`ssd_jax.engine.core`).

It validates, tokenizes, asks the planner (:func:`ssd_jax.planning.configure`) for the draft as it will
run (weight dtype, trimmed head), K and its policy (with K auto, AR rounds where no speculation is
predicted to pay), builds the method (:mod:`ssd_jax.engine.methods`), submits every row (each prompt
times ``n`` samples) at time 0 to an engine with one slot per row, and runs it until every row is done.
Each row draws from its own key (``key(seed)``, the sample index folded in after the first), so a seeded
row gives the same tokens whatever shares its batch, offline as in the server.
"""

from __future__ import annotations

import logging
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax

from ssd_jax.compile import Compiled
from ssd_jax.decoding.batch import GenerationResult, encode_prompts, plan_batch, speed_metrics
from ssd_jax.decoding.spec import SpecConfig
from ssd_jax.drafters.vocab import load_with_head
from ssd_jax.engine.core import Engine, Mode
from ssd_jax.engine.core import Sequence as Seq
from ssd_jax.engine.methods import build_method
from ssd_jax.errors import UserError
from ssd_jax.parallel.distributed import multi_process
from ssd_jax.planning import configure
from ssd_jax.sampling.filters import SamplingParams

log = logging.getLogger(__name__)


def generate(
    model,
    prompts: Sequence[str | Sequence[int]],
    sampling: SamplingParams | None = None,
    spec: SpecConfig | None = None,
    *,
    chat: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    trace: str | None = None,
) -> GenerationResult:
    """Generate continuations for ``prompts`` (strings, or lists of token ids).

    Args:
      model: a loaded model (``ssd_jax.load_model``).
      prompts: one entry per request.
      sampling: how to sample (default greedy, 128 new tokens).
      spec: speculation config (default plain autoregressive decoding).
      chat: wrap each prompt as a user message in the model's chat template.
      on_text: streaming callback ``(row, new_text)``.
      trace: SSD only: write a Chrome / Perfetto trace of the device work to this path.

    Returns:
      GenerationResult with one output per prompt and sample (``prompt``, ``text``,
      ``token_ids``, ``finish_reason``) and the run's ``metrics``.
    """
    sampling = sampling or SamplingParams()
    spec = spec or SpecConfig()
    sampling.validate()
    spec.validate()
    if not prompts:
        raise UserError("no prompts given")
    ids = encode_prompts(model, prompts, chat)
    load = functools.partial(load_with_head, dtype=model.cfg.dtype)  # a draft trained trimmed keeps its head
    spec, plan = configure(model, spec, rows=len(ids) * sampling.n, load=load, round_timer=_time_rounds)
    spec.validate()
    # the plan runs AR rounds: SD on one device and SSD run them in their own rounds (their policy); a
    # method whose K is fixed, or SSD traced (stage by stage, no switch), runs the target's AR method
    ar_method = plan.ar_rounds and (spec.k_plan is None or bool(trace and spec.method == "ssd"))
    if ar_method and trace:
        log.warning(f"warning: no trace written, {plan.line()[6:]} (--k N traces SSD)")
    method = build_method(model, spec, (Mode.of([sampling]),), load, trace=trace, ar_rounds=ar_method)
    rows_ids = [list(x) for x in ids for _ in range(sampling.n)]
    _, max_len = plan_batch(model, rows_ids, sampling, spec)
    draft = method.draft
    if draft is not None:
        plan_batch(draft, rows_ids, sampling, spec)  # the draft's context window must hold the batch too
    c0 = Compiled.total_s
    engine = Engine(method, max_batch=len(rows_ids), max_len=max_len)
    res = _run(engine, list(prompts), rows_ids, sampling, on_text)
    res.metrics["compile_s"] += plan.calibration_s + (
        Compiled.total_s - c0
    )  # the calibration counts as compile
    k_auto = plan.k_auto
    if k_auto is not None:  # did the engine re-choose K every round (one-device SD), or keep it fixed
        k_auto = {**k_auto, "adaptive": bool(res.metrics.get("k_adaptive"))}
    res.metrics["k_auto"] = k_auto
    res.metrics["draft_auto"] = plan.draft_auto
    res.metrics["plan"] = plan.to_json()
    res.metrics["plan"]["forms"] = forms_summary(model.cfg, draft.cfg if draft is not None else None)
    if spec.method == "ssd" and not plan.ar_rounds:  # the prediction, Theorem 7's bound, the measurement
        from ssd_jax.planning.ssd_model import run_check

        if (check := run_check(res.metrics["plan"], res.metrics, len(rows_ids))) is not None:
            res.metrics["plan"]["theorem7"] = check
    if spec.draft_dtype is not None:
        res.metrics["draft_dtype"] = spec.draft_dtype
    if spec.draft_vocab is not None:
        res.metrics["draft_vocab"] = spec.draft_vocab
    elif spec.method != "ar":
        from ssd_jax.drafters.vocab import head_vocab

        if (n := head_vocab(spec.draft)) is not None:  # a draft trained with a trimmed head decodes with it
            res.metrics["draft_vocab"] = n
    return _record_cpus(res, spec)


def forms_summary(target_cfg, draft_cfg=None) -> dict:
    """The CPU kernels' build and the matmul forms each model runs (measured on this machine at load:
    ``ssd_jax.models.form_timing``), for the run's JSON and its plan lines."""
    from ssd_jax.models import kernels
    from ssd_jax.models.form_timing import describe

    out = {
        "kernels": kernels.isa() if jax.default_backend() == "cpu" else "off",
        "target": describe(target_cfg.forms),
    }
    if draft_cfg is not None:
        out["draft"] = describe(draft_cfg.forms)
    out["line"] = f"kernels {out['kernels']}; target forms: {out['target']}"
    return out


def _time_rounds(spec: SpecConfig) -> dict:
    """Seconds a round of AR, SD and SSD on the tiny model (compute about zero: the engine's fixed cost)
    on ``spec``'s layout, for the planner (:mod:`ssd_jax.planning.overhead`: what is run and why)."""
    import numpy as np

    from ssd_jax.planning import overhead as oh

    tiny = oh.tiny_model()
    sp = SamplingParams(max_new_tokens=oh.TOKENS, ignore_eos=True)
    devices = {"target_devices": spec.target_devices, "draft_devices": spec.draft_devices}
    common = dict(draft=tiny, k=oh.K, draft_dtype=None, draft_vocab=None)
    if devices["target_devices"] is not None or devices["draft_devices"] is not None:
        common.update(devices)
    specs = {
        "ar_s": SpecConfig(),
        "sd_s": SpecConfig(method="sd", **common),
        "ssd_s": SpecConfig(method="ssd", backup="neural", **common),
    }
    out = {}
    for name, s in specs.items():
        times = []
        for i in range(oh.WARM + oh.REPEATS):
            m = generate(tiny, [list(oh.PROMPT)], sp, s).metrics
            if i >= oh.WARM:
                times.append((m["wall_s"] - m["ttft_s"]) / max(1, m.get("verify_steps", m.get("steps", 1))))
        out[name] = float(np.median(times))
    return out


def _run(engine: Engine, prompts, rows_ids, sampling: SamplingParams, on_text) -> GenerationResult:
    """Submit every row at time 0, run the engine to the end, and collect outputs and metrics. Compile
    time met on the way (first use of a shape) is reported in ``compile_s`` and not counted as decoding."""
    import time

    n = sampling.n
    seqs = []
    for i, ids in enumerate(rows_ids):
        sink = None
        if on_text is not None:
            sink = functools.partial(lambda b, kind, x: on_text(b, x) if kind == "text" else None, i)
        sp = dataclasses.replace(sampling, n=1)
        seqs.append(Seq(ids, sp, sink, index=i % n, prompt=prompts[i // n]))
    c0 = Compiled.total_s
    engine.submit(seqs)
    t0 = time.perf_counter()
    engine.admit()  # the prefill: every row's first token
    ttft = time.perf_counter() - t0 - (Compiled.total_s - c0)
    engine.run()
    compile_s = Compiled.total_s - c0
    wall = time.perf_counter() - t0 - compile_s
    rows = [s.row for s in seqs]
    m = speed_metrics(rows, wall, ttft, 0.0, [len(r) for r in rows_ids])
    method = engine.method
    m.update(method.metrics(wall, ttft, engine.rounds))
    if method.speculates:
        m.update(
            {
                "verify_steps": engine.rounds,
                **engine.stats.metrics(),
                "round_s": wall - ttft,
                "prefill_s": ttft,
            }
        )
    else:
        m["steps"] = engine.rounds + 1
    outputs = []
    for b, s in enumerate(seqs):
        o = s.row.output()
        if s.logprobs is not None:  # per token: (log p, [(id, log p)] of the best alternatives)
            o["logprobs"] = s.logprobs
        if method.speculates:
            o["metrics"] = {
                **engine.stats.row_metrics(b),
                **method.row_metrics(b),
            }
        outputs.append(o)
    return GenerationResult(outputs, m, method=method.name)


def _record_cpus(res: GenerationResult, spec: SpecConfig) -> GenerationResult:
    """``cpus``: the cores this process may run on (``SSD_JAX_CPUS``, ``launch --cpus-per-process``).
    When the run's meshes span processes, also ``process_cpus`` (each process's, in process order) and,
    beside the meshes' processes, ``devices.target_cpus`` / ``draft_cpus`` (process 0's metrics only; a
    collective, so only where every process runs this generate: a one-device run under
    ``jax.distributed`` is each process's own, and a peer may not be running it at all)."""
    from ssd_jax.xla_env import cpus

    m = res.metrics
    m["cpus"] = cpus()
    if multi_process() and (spec.target_devices is not None or spec.draft_devices is not None):
        from ssd_jax.parallel.distributed import gather_to_main  # every process runs this generate

        per = gather_to_main(m["cpus"])
        if per is not None:
            m["process_cpus"] = per
            dev = m.get("devices")
            for side in ("target", "draft"):
                if isinstance(dev, dict) and f"{side}_processes" in dev:
                    dev[f"{side}_cpus"] = sorted({c for i in dev[f"{side}_processes"] for c in per[i]})
    return res
