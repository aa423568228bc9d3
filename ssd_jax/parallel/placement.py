"""Placement: models, KV caches and small host arrays on a model's mesh (or its one device), and
the disjoint target and draft meshes of SSD. The mesh is the ``LoadedModel.mesh`` field.

Under ``jax.distributed`` the two meshes may belong to different processes; then
:meth:`Placement.to_target` / :meth:`Placement.to_draft` move arrays with a collective
(:class:`.distributed.Bridge`) instead of ``jax.device_put``, and return a copy every process can
read on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ssd_jax.models import llama
from ssd_jax.parallel.distributed import Bridge, host_value, local_copy, multi_process


def cache_for(model, batch: int, max_len: int, paged: tuple[int, int] | None = None) -> llama.KVCache:
    """The model's KV cache for ``batch`` rows of ``max_len`` slots; ``paged`` (blocks, block size): a
    paged cache (one device only)."""
    if paged is not None:
        if model.mesh is not None and model.mesh.size > 1:
            raise ValueError("a paged KV cache runs on one device")
        return jax.tree.map(
            lambda x: put_on(model, x), llama.init_paged_cache(model.cfg, batch, max_len, *paged)
        )
    cache = llama.init_cache(model.cfg, batch, max_len)
    mesh = model.mesh
    if mesh is not None:
        from ssd_jax.parallel.sharding import cache_sharding, replicated

        sh = cache_sharding(model.cfg, mesh, batch, max_len)
        cache = llama.KVCache(
            [jax.device_put(local_copy(x), sh) for x in cache.k],
            [jax.device_put(local_copy(x), sh) for x in cache.v],
            jax.device_put(local_copy(cache.lengths), replicated(mesh)),
        )
    return cache


def put_on(model, x):
    """Place a small host array where the model lives (replicated over its mesh)."""
    mesh = model.mesh
    if mesh is None:
        return jax.device_put(x)
    from ssd_jax.parallel.sharding import replicated

    return jax.device_put(local_copy(x), replicated(mesh))


@dataclasses.dataclass
class Placement:
    target: object  # the target model, placed
    draft: object  # the draft model, placed
    target_devices: list
    draft_devices: list
    single: bool
    bridge: Bridge | None = None  # the meshes span processes: moves go through a collective

    def put_target(self, x):
        return jax.device_put(local_copy(x), self._t_rep)

    def put_draft(self, x):
        return jax.device_put(local_copy(x), self._d_rep)

    def to_target(self, tree):
        """Draft-mesh arrays onto the target mesh: (moved, a copy every process can read)."""
        if self.bridge is not None:
            return self.bridge.move(tree, "target")
        moved = jax.tree.map(self.put_target, tree)
        return moved, moved

    def to_draft(self, tree):
        """Target-mesh arrays onto the draft mesh: (moved, a copy every process can read)."""
        if self.bridge is not None:
            return self.bridge.move(tree, "draft")
        moved = jax.tree.map(self.put_draft, tree)
        return moved, moved

    @staticmethod
    def read(x) -> np.ndarray:
        """Host value of an array from :meth:`to_target` / :meth:`to_draft` (or of a local one)."""
        return host_value(x)


def place(target, draft, spec) -> Placement:
    """Put the target on its (tensor-parallel) mesh and the draft on a disjoint mesh.

    Without device counts both share this process's first device (single-device mode: under
    ``jax.distributed`` every process then runs the whole computation on its own device).
    """
    from ssd_jax.parallel.sharding import make_mesh, replicated, shard_params, split_devices

    if spec.target_devices is None and spec.draft_devices is None:
        dev = jax.local_devices()[0]
        pl = Placement(target, draft, [dev], [dev], True)
        pl._t_rep = pl._d_rep = jax.sharding.SingleDeviceSharding(dev)
        return pl
    tdevs, ddevs = split_devices(spec.target_devices, spec.draft_devices, separate=True)
    tmesh, dmesh = make_mesh(tdevs), make_mesh(ddevs)
    t = dataclasses.replace(target, params=shard_params(target.cfg, target.params, tmesh), mesh=tmesh)
    rep = replicated(dmesh)
    d = dataclasses.replace(
        draft, params=jax.tree.map(lambda x: jax.device_put(local_copy(x), rep), draft.params), mesh=dmesh
    )
    pl = Placement(t, d, list(tdevs), list(ddevs), False, Bridge(tmesh, dmesh) if multi_process() else None)
    pl._t_rep, pl._d_rep = replicated(tmesh), rep
    return pl
