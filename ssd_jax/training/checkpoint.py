"""The output directory of a run: metadata, step log, orbax training states and the best export
(layout: :mod:`ssd_jax.loading.draft`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.loading import draft as dfmt
from ssd_jax.models.params import flatten


def log(msg: str) -> None:
    """A line on stderr that does not break an active progress bar."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def tensors_sha256(params) -> str:
    return dfmt.shared_sha256({k: np.asarray(v) for k, v in flatten(params).items()})


class RunDir:
    """The output directory of a run: metadata, step log, orbax states, best export."""

    def __init__(self, out: str | os.PathLike, keep: int = 2):
        self.path = Path(out)
        self.meta_path = self.path / dfmt.DRAFT_META
        self.log_path = self.path / "train_log.jsonl"
        self.state_dir = self.path / dfmt.STATE_DIR
        self.best_dir = self.path / dfmt.BEST_DIR
        self.keep = keep
        self._mngr = None

    def has_run(self) -> bool:
        return self.meta_path.exists() or self.state_dir.exists()

    @property
    def manager(self):
        if self._mngr is None:
            import orbax.checkpoint as ocp

            dfmt.quiet_orbax()
            opts = ocp.CheckpointManagerOptions(
                max_to_keep=self.keep,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
                create=True,
            )
            self._mngr = ocp.CheckpointManager(self.state_dir.absolute(), options=opts)
        return self._mngr

    def save(self, step: int, params, opt_state) -> None:
        import orbax.checkpoint as ocp

        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state)
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore_latest(self, params, opt_state) -> tuple[int, Any, Any] | None:
        """(step, params, opt_state) of the newest step that restores, or None if there is none."""
        import jax
        import orbax.checkpoint as ocp

        abs_p = jax.tree.map(ocp.utils.to_shape_dtype_struct, params)
        abs_o = jax.tree.map(ocp.utils.to_shape_dtype_struct, opt_state)
        damaged = []
        for s in dfmt.complete_steps(self.state_dir):
            try:
                r = self.manager.restore(
                    s,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(abs_p), opt_state=ocp.args.StandardRestore(abs_o)
                    ),
                )
            except Exception as e:  # a damaged step: fall back to the one before
                log(
                    f"state step {s} does not restore ({type(e).__name__}: {str(e).splitlines()[0][:160]}); trying older"
                )
                damaged.append(s)
                continue
            for d in damaged:  # newer than the restored step and unusable: they would block re-saving
                shutil.rmtree(self.state_dir / str(d), ignore_errors=True)
            if damaged:
                self.manager.reload()
            return s, r["params"], r["opt_state"]
        return None

    def export(self, dest: Path, params, meta: dict[str, Any]) -> None:
        """Write a params-only draft (draft.json + params/) to ``dest`` atomically (tmp dir + rename)."""
        import orbax.checkpoint as ocp

        dfmt.quiet_orbax()
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir(parents=True)
            with ocp.StandardCheckpointer() as ck:
                ck.save((tmp / dfmt.PARAMS_DIR).absolute(), params)
                ck.wait_until_finished()
            dfmt.write_json_atomic(tmp / dfmt.DRAFT_META, meta)
            old = None
            if dest.exists():
                old = dest.parent / f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.rename(dest, old)
            os.rename(tmp, dest)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def recover_best(self) -> None:
        """A kill between the two renames of :meth:`export` leaves only ``.best.old-*``: put it back."""
        if self.best_dir.exists():
            for p in self.path.glob(f".{dfmt.BEST_DIR}.*"):
                shutil.rmtree(p, ignore_errors=True)
            return
        olds = sorted(self.path.glob(f".{dfmt.BEST_DIR}.old-*"))
        if olds and dfmt.is_draft_dir(olds[-1]):
            os.rename(olds[-1], self.best_dir)
        for p in self.path.glob(f".{dfmt.BEST_DIR}.*"):
            shutil.rmtree(p, ignore_errors=True)

    def append_log(self, rec: dict[str, Any]) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def truncate_log(self, step: int) -> None:
        if not self.log_path.exists():
            return
        keep = []
        with open(self.log_path) as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        keep.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    break  # a line cut by a kill ends the usable log
        tmp = self.log_path.with_name(f".{self.log_path.name}.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, self.log_path)

    def close(self) -> None:
        if self._mngr is not None:
            self._mngr.close()
            self._mngr = None
