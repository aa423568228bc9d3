"""A trained draft's orbax checkpoint in a multi-process run: every process restores it to the host
with no collective (whichever process holds the draft's devices), bit for bit what a single-process
device restore gives, and SSD with the draft in its own process emits greedy AR's tokens."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from helpers import launch_cmd, launch_env, ssd_decode_args
from test_train import TARGET_CFG, save_tiny_target

from ssd_jax.loading import draft as dfmt
from ssd_jax.models.params import flatten

IDS = [[5, 6, 7], [9, 10, 11, 12]]
N_NEW = 8
STEP = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run directory, the trained tensors saved): a tiny target, and a draft run saved by the training
    loop's own saver (:class:`RunDir`: ``draft.json``, ``state/<step>/`` and the ``best/`` export)."""
    import jax
    import optax

    from ssd_jax.loading import load_model
    from ssd_jax.training.checkpoint import RunDir, tensors_sha256
    from ssd_jax.training.draft_model import init_trained, shared_names, size_draft

    root = tmp_path_factory.mktemp("dist-ckpt")
    save_tiny_target(root, "cd")
    target = load_model(root / "target", forms="canonical")
    cfg, _ = size_draft(target.cfg, "40K")
    assert cfg.num_layers < TARGET_CFG.num_layers
    params = init_trained(target.params, target.cfg, cfg, "first", 0)
    rng = np.random.default_rng(1)  # a "trained" draft: the target's first layer, moved a little
    params = jax.tree.map(lambda x: x + 0.02 * rng.standard_normal(x.shape).astype(np.float32), params)
    params = jax.device_put(params, jax.devices()[0])
    shared = shared_names(target.cfg)
    meta = {
        "format": dfmt.FORMAT,
        "format_version": dfmt.FORMAT_VERSION,
        "name": "tiny-draft",
        "target": {
            "name": str(root / "target"),
            "path": str(root / "target"),
            "weights_sha256": target.weights_sha256,
        },
        "shared": {
            "tensors": shared,
            "sha256": dfmt.shared_sha256({n: np.asarray(target.params[n]) for n in shared}),
            "from": "target",
        },
        "config": cfg.replace(dtype="float32").to_dict(),
        "step": STEP,
    }
    run = RunDir(root / "run")
    run.path.mkdir()
    dfmt.write_json_atomic(run.meta_path, meta)
    run.save(STEP, params, optax.adam(1e-3).init(params))
    run.export(run.best_dir, params, {**meta, "params_sha256": tensors_sha256(params)})
    run.close()
    return run.path, {k: np.asarray(v) for k, v in flatten(params).items()}


@pytest.mark.parametrize("layout", ["best", "state"])
def test_restore_is_host_numpy_bit_identical_to_a_device_restore(trained, layout):
    import jax
    import orbax.checkpoint as ocp

    path, saved = trained
    meta = dfmt.read_meta(path)
    cfg = dfmt.draft_config(meta)
    item = path / "best" / "params" if layout == "best" else path / "state" / str(STEP) / "params"
    abstract = dfmt._abstract_trained(cfg, meta["shared"]["tensors"])
    host = flatten(dfmt.restore_params(item, abstract))
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # the single-process restore of before
    on_dev = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev), abstract)
    with ocp.StandardCheckpointer() as ck:
        ref = flatten(ck.restore(item.absolute(), on_dev))
    assert sorted(host) == sorted(ref) == sorted(saved)
    for k, v in host.items():
        assert type(v) is np.ndarray and v.dtype == np.float32, k
        assert v.tobytes() == np.asarray(ref[k]).tobytes() == saved[k].tobytes(), k
    if layout == "best":  # the whole loaded draft: what the two-process run below decodes with
        from ssd_jax.loading import load_numpy

        m = load_numpy(path)
        assert m.source.endswith("best/params")
        for k, v in saved.items():
            assert m.flat[k].tobytes() == v.tobytes(), k


def test_restore_rejects_a_checkpoint_of_other_shapes(trained):
    import jax

    path, _ = trained
    meta = dfmt.read_meta(path)
    cfg = dfmt.draft_config(meta)
    abstract = dfmt._abstract_trained(cfg, meta["shared"]["tensors"])
    wrong = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] + 1, *a.shape[1:]), a.dtype), abstract)
    with pytest.raises(ValueError, match="expected"):
        dfmt.restore_params(path / "best" / "params", wrong)


def test_two_process_ssd_with_a_trained_draft_checkpoint_equals_ar(trained, tmp_path):
    """The draft on process 1's device, the target on process 0's: both processes restore the draft."""
    from ssd_jax import SamplingParams, generate, load_model

    path, _ = trained
    target = str(path.parent / "target")
    cmd = launch_cmd(*ssd_decode_args(target, path, IDS, N_NEW, 2))
    p = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    ar = generate(load_model(target), IDS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
    assert [o["token_ids"] for o in res["outputs"]] == [o["token_ids"] for o in ar.outputs]
    dev = res["metrics"]["devices"]
    assert (dev["processes"], dev["target_processes"], dev["draft_processes"]) == (2, [0], [1])
