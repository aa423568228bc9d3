"""Meshes and logical-axis sharding rules.

Logical axis names are declared once with the weights (``ssd_jax.models.params``) and
mapped to mesh axes here, in one table. Tensor parallelism shards attention heads, the
MLP hidden dimension and the vocabulary over the mesh axis ``"tp"``; everything else is
replicated. A logical axis whose size does not divide the mesh axis is replicated rather
than padded (e.g. 2 KV heads on a 4-way mesh), so any model runs on any mesh.

Draft and target each get their own mesh built from disjoint slices of ``jax.devices()``
(which lists every device of every host under ``jax.distributed.initialize``), so the same
code runs on one CPU, one accelerator, a GPU host or a TPU slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ssd_jax.errors import UserError
from ssd_jax.models import params as P
from ssd_jax.models.config import ModelConfig

TP = "tp"

#: logical axis -> mesh axis (None = replicated)
DEFAULT_RULES: dict[str, str | None] = {
    P.VOCAB: TP,
    P.HEADS: TP,
    P.KV_HEADS: TP,
    P.MLP: TP,
    P.EMBED: None,
    P.HEAD_DIM: None,
    "batch": None,
    "seq": None,
}


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D tensor-parallel mesh over ``devices``."""
    return Mesh(np.asarray(list(devices)), (TP,))


def split_devices(target_devices: int | None, draft_devices: int | None = None, *, separate: bool = True):
    """Disjoint device lists for target and draft (first M devices for the target, next N for the draft).

    With ``separate=False`` (single-device mode) both use the same devices.
    """
    devs = jax.devices()
    m = target_devices or (len(devs) if not separate else max(1, len(devs) - (draft_devices or 1)))
    n = draft_devices or (1 if separate else m)
    if m < 1 or n < 1:
        raise UserError(f"device counts must be >= 1 (target {m}, draft {n})")
    need = m + n if separate else max(m, n)
    if need > len(devs):
        raise UserError(
            f"asked for {m} target + {n} draft devices but only {len(devs)} {devs[0].platform} device(s) exist"
        )
    if not separate:
        return devs[:m], devs[:n]
    return devs[:m], devs[m : m + n]


def spec_for(
    shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh, rules=DEFAULT_RULES
) -> PartitionSpec:
    """PartitionSpec for one array from its logical axes, replicating non-divisible axes."""
    used: set[str] = set()
    out = []
    for dim, ax in zip(shape, axes):
        m = rules.get(ax) if ax else None
        if m is None or m in used or dim % mesh.shape[m]:
            out.append(None)
        else:
            used.add(m)
            out.append(m)
    return PartitionSpec(*out)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules=DEFAULT_RULES) -> dict[str, NamedSharding]:
    """Flat parameter name -> NamedSharding."""
    return {
        name: NamedSharding(mesh, spec_for(shape, axes, mesh, rules))
        for name, (shape, axes) in P.param_specs(cfg).items()
    }


def shard_params(cfg: ModelConfig, params: P.Params, mesh: Mesh) -> P.Params:
    """Place (or move) a parameter pytree onto ``mesh`` by the logical rules."""
    from ssd_jax.parallel.distributed import local_copy

    sh = param_shardings(cfg, mesh)
    flat = P.flatten(params)
    return P.unflatten(cfg, {k: jax.device_put(local_copy(v), sh[k]) for k, v in flat.items()})


def cache_sharding(cfg: ModelConfig, mesh: Mesh, batch: int, max_len: int) -> NamedSharding:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return NamedSharding(mesh, spec_for(shape, ("batch", "seq", P.KV_HEADS, P.HEAD_DIM), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
