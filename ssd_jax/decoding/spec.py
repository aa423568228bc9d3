"""The speculative-decoding configuration, spelled the way serving engines spell it.

``SpecConfig`` is the ``spec`` argument of :func:`ssd_jax.generate` and the source of the
CLI flags ``--method --draft --k --prompt-lookup-min/max --draft-vocab`` (SD) and ``--fan-out
--fan-out-budget --saguaro-c --backup --draft-devices --target-devices`` (SSD).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ssd_jax.errors import UserError

METHODS = ("ar", "sd", "ssd")
#: weight dtypes a draft model may be stored in (``SpecConfig.draft_dtype``, ``--draft-dtype``)
DRAFT_DTYPES = ("float32", "bfloat16")
#: ``k="auto"`` chooses K among 1..K_MAX
K_MAX = 8


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How to speculate.

    Attributes:
      method: "ar" (no speculation), "sd" (draft + verify) or "ssd" (speculative speculative).
      draft: a draft model name or path, "ngram", "random", or a loaded model object.
      k: speculative tokens per round (vLLM's num_speculative_tokens), or "auto" (the default):
        chosen in 1..8 from a short measurement of this machine's stage costs and the draft's
        acceptance, cached on disk (:mod:`ssd_jax.planning`); ``metrics["k"]`` is the K used.
      prompt_lookup_min / prompt_lookup_max: n-gram sizes for the n-gram drafter.
      fan_out: SSD fan-out, an int (uniform) or "geometric".
      fan_out_budget: SSD branches per sequence (sum of the per-position fan-outs); geometric
        default 2·(K+1); a uniform fan-out F uses F·(K+1).
      saguaro_c: Saguaro down-weighting of cached tokens in the draft distribution (1 = off).
      backup: SSD cache-miss fallback: "neural", "ngram", "random" or "auto".
      target_devices / draft_devices: mesh sizes (None = automatic).
      profile_stages: SD / SSD: run each round as separate draft / verify / sample (SSD: verify,
        build, sample, lookup) calls on a timeline, to measure the time of each stage
        (``draft_s``, ``verify_s``, ``sample_s``; SSD's overlap). Off by default: a round is
        then ONE compiled call (SSD on two meshes: one per target call, two draft calls), queued
        before the previous round's tokens are read, and the stage times are reported as null.
      draft_vocab: keep only the N most frequent target tokens in the draft model's output head
        (``ssd_jax.drafters.vocab``; None = the full vocabulary). Exact: q is 0 outside the kept set.
        "auto" (the default): the full head or a trimmed one, whichever the calibration expects to
        be faster for this pair on this machine (:mod:`ssd_jax.planning.variants`).
      draft_dtype: store the draft model's weight matrices in this dtype ("float32" or "bfloat16";
        None = the target's dtype) while it computes in the target's dtype. Exact whatever it is
        (the draft only proposes); on CPU a float32 target with a "bfloat16" draft halves the
        bytes each draft step streams (the CPU kernel widens them in registers). "auto" (the
        default): chosen by the calibration, as ``draft_vocab``.
      k_plan: SD only: choose K again after every round from the run's own acceptance
        (a :class:`ssd_jax.planning.policy.KPolicy`, e.g. ``KPlan``: the calibration's α as a prior and its stage
        costs; ``k`` is the first round's K). ``k="auto"`` sets it for SD on one device (the
        default loop; the two-mesh and ``profile_stages`` loops keep K fixed); None = K fixed.
        ``metrics`` then has ``k_mean``, ``k_rounds`` and ``alpha_online``.
      draft_context: SD with a draft model on one device: the draft prefills and attends to only the
        last ``draft_context`` tokens of each prompt (rounded down to a prefill chunk's start; plus
        everything generated), which saves most of its prefill on long prompts. Exact (the draft
        only proposes); None (the default): the whole prompt.
    """

    method: str = "ar"
    draft: Any = None
    k: int | str = "auto"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    fan_out: int | str = "geometric"
    fan_out_budget: int | None = None
    saguaro_c: float = 1.0
    backup: str = "auto"
    target_devices: int | None = None
    draft_devices: int | None = None
    profile_stages: bool = False
    draft_vocab: int | str | None = "auto"
    k_plan: Any = None
    draft_dtype: str | None = "auto"
    draft_context: int | None = None

    def validate(self, n_devices: int | None = None) -> None:
        """Raise UserError for any value out of range (whatever the method, so a typo in an
        SSD flag is reported even with ``--method ar``), then for combinations the method
        cannot run. ``n_devices``: devices available, to check the mesh sizes against."""
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.k != "auto":
            if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)):
                raise UserError(f"k must be an integer >= 1 or 'auto', got {self.k!r}")
            if self.k < 1:
                raise UserError(f"k must be >= 1, got {self.k}")
        if self.k_plan is not None and not callable(getattr(self.k_plan, "k_for", None)):
            raise UserError(
                f"k_plan must be a K policy (ssd_jax.planning.policy), got {type(self.k_plan).__name__}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise UserError(
                f"need 1 <= prompt-lookup-min <= prompt-lookup-max, got {self.prompt_lookup_min} and "
                f"{self.prompt_lookup_max}"
            )
        self._validate_ranges(n_devices)
        if self.draft_dtype not in (None, "auto"):
            if self.method == "ar":
                raise UserError("--draft-dtype sets the draft model's weights; method ar has no draft")
            if isinstance(self.draft, str) and self.draft in ("ngram", "random"):
                raise UserError(
                    f"--draft-dtype sets a draft model's weights; the {self.draft} drafter has none"
                )
        if self.draft_vocab not in (None, "auto"):
            if self.method == "ar":
                raise UserError("--draft-vocab trims the draft model's head; method ar has no draft")
            if isinstance(self.draft, str) and self.draft in ("ngram", "random"):
                raise UserError(
                    f"--draft-vocab trims a draft model's head; the {self.draft} drafter has none"
                )
        if self.method != "ar" and self.draft is None:
            raise UserError(f"method {self.method} needs a draft (--draft NAME_OR_PATH|ngram|random)")
        if self.method == "ssd":
            if isinstance(self.draft, str) and self.draft in ("ngram", "random"):
                raise UserError(
                    "method ssd needs a draft model (--draft NAME_OR_PATH); ngram and random serve as "
                    "--backup"
                )
            if self.fan_out != "geometric" and self.fan_out_budget is not None:
                f = int(self.fan_out)
                if self.k == "auto":
                    raise UserError(
                        f"uniform fan-out {f} uses {f}*(k+1) branches, so a fan-out budget fixes k: give --k "
                        f"or drop --fan-out-budget"
                    )
                if self.fan_out_budget != f * (self.k + 1):
                    raise UserError(
                        f"uniform fan-out {f} with k={self.k} uses {f * (self.k + 1)} branches; drop --fan-out-budget "
                        f"or use --fan-out geometric"
                    )

    def _validate_ranges(self, n_devices: int | None) -> None:
        if self.fan_out != "geometric":
            try:
                f = int(self.fan_out)
            except (TypeError, ValueError):
                raise UserError(f"fan-out must be an integer or 'geometric', got {self.fan_out!r}") from None
            if f < 1:
                raise UserError(f"fan-out must be >= 1, got {f}")
        dv = self.draft_vocab
        if dv not in (None, "auto") and (
            isinstance(dv, bool) or not isinstance(dv, (int, np.integer)) or dv < 1
        ):
            raise UserError(
                f"draft-vocab must be a positive integer (tokens kept in the draft's head), got {dv!r}"
            )
        if self.draft_dtype not in (None, "auto", *DRAFT_DTYPES):
            raise UserError(
                f"unknown draft dtype {self.draft_dtype!r} (choose from {', '.join(DRAFT_DTYPES)})"
            )
        dc = self.draft_context
        if dc is not None and (isinstance(dc, bool) or not isinstance(dc, (int, np.integer)) or dc < 1):
            raise UserError(f"draft-context must be a positive number of tokens, got {dc!r}")
        if dc is not None and (self.method != "sd" or self.draft in ("ngram", "random")):
            raise UserError("--draft-context applies to SD with a draft model (--method sd --draft MODEL)")
        if dc is not None and (self.target_devices is not None or self.draft_devices is not None):
            raise UserError(
                "--draft-context runs with both models on one device (no --target/--draft-devices)"
            )
        if self.fan_out_budget is not None and self.fan_out_budget < 1:
            raise UserError(f"fan-out budget must be >= 1, got {self.fan_out_budget}")
        if not 0.0 <= self.saguaro_c <= 1.0:  # also false for nan
            raise UserError(f"saguaro-c must be in [0, 1], got {self.saguaro_c}")
        if self.backup not in ("neural", "ngram", "random", "auto"):
            raise UserError(f"unknown backup {self.backup!r} (choose from neural, ngram, random, auto)")
        for name, n in (("target", self.target_devices), ("draft", self.draft_devices)):
            if n is not None and n < 1:
                raise UserError(f"--{name}-devices must be >= 1, got {n}")
        if n_devices is not None and (self.target_devices is not None or self.draft_devices is not None):
            t, d = self.target_devices or 1, self.draft_devices or 1
            if t + d > n_devices:
                raise UserError(
                    f"asked for {t} target + {d} draft devices but only {n_devices} device(s) exist"
                )

    @property
    def extra_cache_slots(self) -> int:
        """Cache slots needed beyond prompt + new tokens (speculative tokens in flight)."""
        if self.method == "ar":
            return 0
        k = K_MAX if self.k == "auto" else self.k
        if self.k_plan is not None:  # K adaptive: room for the largest K the run may switch to
            k = max(k, *self.k_plan.ks)
        return k + 1
