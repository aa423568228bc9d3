"""SSD's miss path as one part of its method: which backups may draft a row whose lookup missed (the
neural draft, random tokens or the n-gram lookup on the host, ``kind`` ``"host"``), which one drafts a
row's first speculation, and, where two may serve (``--backup auto`` on hardware of the draft's own), the
choice between them each round by the critical batch size b* (Theorem 6: :func:`~ssd_jax.decoding.ssd.
fanout.critical_batch_size`) from the running means of what each has given and the priced costs."""

from __future__ import annotations

import numpy as np

from ssd_jax.decoding.ssd import fanout as fo
from ssd_jax.decoding.ssd.backup import RunningMeans, backup_cost_estimate


class BackupChoice:
    def __init__(self, backup: str, single_device: bool, k: int):
        # auto on one device is the neural backup: the n-gram lookup needs the round's tokens on the host,
        # which splits the fused round into three calls over every slot and a host read (SmolLM2, one live
        # row in an 8-slot engine: 62-67 ms a token against 24-25 with the neural backup); b* decides
        # between them where the draft has hardware of its own
        auto = ["neural"] if single_device else ["neural", "host"]
        self.kinds = {"neural": ["neural"], "random": ["random"], "ngram": ["host"], "auto": auto}[backup]
        self.first = "random" if backup == "random" else "neural"  # the backup of a row's first speculation
        self.b_star: float | None = None
        self.next = "neural"  # the kind the last dispatched round looked up with
        # priors until rounds are seen (hit rate, tokens per round after a hit, after each backup)
        self.means = RunningMeans(p_hit=0.6, e_hit=1 + 0.7 * k, e_neural=1 + 0.7 * k, e_fast=1.2)
        self.costs: dict = {}

    def price(self, target_cfg, draft_cfg, *, batch, k, budget, draft_devices, context, device) -> None:
        """The backups' costs per round on this hardware (:func:`backup_cost_estimate`)."""
        self.costs = backup_cost_estimate(
            target_cfg, draft_cfg, batch=batch, k=k, budget=budget, draft_devices=draft_devices,
            context=context, device=device,
        )  # fmt: skip

    @property
    def uses_host(self) -> bool:
        """Whether the n-gram lookup may run (it keeps each row's history on the host)."""
        return "host" in self.kinds

    def choose(self, live: np.ndarray) -> str:
        """The kind a round over the ``live`` slots looks up with."""
        if len(self.kinds) == 1:  # one backup (auto on one device: the neural one)
            kind = self.kinds[0]
        else:
            m, c = self.means, self.costs
            self.b_star = fo.critical_batch_size(
                m["p_hit"], m["e_hit"], m["e_neural"], m["e_fast"], c["t_primary"], c["t_neural"], c["t_fast"]
            )
            kind = "neural" if int(live.sum()) < self.b_star else "host"
        return kind

    def learn(self, live: np.ndarray, n_acc: np.ndarray, cur, nxt, batch: int) -> None:
        """A round's tokens after a hit and after each backup (``cur``: the speculations it verified), and
        its rows' hit rate (``nxt``: the next lookup's)."""
        emitted = n_acc + 1
        for name, sel in (
            ("e_hit", cur.hit),
            ("e_neural", ~cur.hit & ~cur.post_miss),
            ("e_fast", cur.post_miss),
        ):
            if (sel & live).any():
                self.means.add(name, float(emitted[sel & live].mean()))
        if live.any():
            self.means.add("p_hit", float(nxt.hit[live].mean()), n=float(live.sum()) / max(batch, 1))
