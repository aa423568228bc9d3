"""The planner: every automatic choice of a run (the draft's dtype and vocabulary, K, SSD's fan-out budget,
K per batch bucket, a head's K), from measurements of this machine, in one place.

One entry, :func:`configure` (``generate()``, the server and the benchmarks call it), and one result, a
:class:`Plan` record that each run prints in one line and stores in its metrics (``metrics["plan"]``).
The modules, in the order a choice is made:

==================  ==================================================================================
``calibration``     what is measured: the target's greedy continuation of built-in prompts, the draft's
                    acceptance α and token ranks on it, the stage costs (decode, verify, draft steps)
``records``         the typed :class:`Calibration` record, cached on disk per machine, cores, jax
                    version, model pair and batch size
``sd_model``        SD's round model S(K) = E(α, K)·t_ar / (c_round + K·t_draft + t_verify(K + 1))
``ssd_model``       SSD's round model: simulated hits, the build's cost, overlap or not, its fixed cost
                    and the miss path (K, budget, backup); Theorem 7's bound for a run's report
``overhead``        the tiny model SSD's fixed cost a round is timed on at start-up
``head_model``      SD with an EAGLE-style head: S(K) from the head's acceptance curve
``variants``        the draft's weight dtype and head size, priced by the models above
``policy``          what the engine asks every round: ``k_for(bucket, alpha)`` (KPlan, BucketPlans,
                    BucketSwitch) and the online α (OnlineK)
``configure``       the entry: draft → variant → K → policy, and the Plan
==================  ==================================================================================
"""

from ssd_jax.planning.configure import Plan, configure
from ssd_jax.planning.policy import BucketPlans, BucketSwitch, KPlan, KPolicy, OnlineK

__all__ = ["BucketPlans", "BucketSwitch", "KPlan", "KPolicy", "OnlineK", "Plan", "configure"]
