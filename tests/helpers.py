"""Shared by the tests that start subprocesses: the XLA flags of the test run, and ``python -m
ssd_jax.launch ... decode``'s command, environment and tokens."""

from __future__ import annotations

import os
import sys


def xla_flags(*flags: str) -> str:
    """``flags`` and the test run's XLA flags (``SSD_JAX_TEST_XLA_FLAGS``, set by conftest.py), for a
    subprocess whose ``XLA_FLAGS`` the test sets itself."""
    return " ".join([*flags, *os.environ.get("SSD_JAX_TEST_XLA_FLAGS", "").split()])


def prompt_id_args(ids) -> list[str]:
    """``--prompt-ids a,b,c`` for each prompt of token ids."""
    return [a for p in ids for a in ("--prompt-ids", ",".join(map(str, p)))]


def launch_cmd(
    *decode_args: str,
    processes: int = 2,
    devices_per_process: int = 1,
    cpus_per_process: int | None = None,
    no_kill: bool = False,
) -> list[str]:
    """The launcher on the CPU platform running ``decode`` with ``decode_args`` in every process."""
    return [
        sys.executable,
        "-m",
        "ssd_jax.launch",
        "--processes",
        str(processes),
        "--devices-per-process",
        str(devices_per_process),
        *(["--cpus-per-process", str(cpus_per_process)] if cpus_per_process else []),
        "--platform",
        "cpu",
        *(["--no-kill"] if no_kill else []),
        "decode",
        *decode_args,
    ]


def ssd_decode_args(target: str, draft: str, ids, n_new: int, k: int) -> list[str]:
    """Greedy SSD with the target on process 0's device and the draft (float32, full vocabulary) on
    process 1's, ``n_new`` tokens per prompt, JSON out."""
    return [
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--method",
        "ssd",
        "--target-devices",
        "1",
        "--draft-devices",
        "1",
        *prompt_id_args(ids),
        "--max-new-tokens",
        str(n_new),
        "--ignore-eos",
        "--k",
        str(k),
        "--draft-dtype",
        "float32",
        "--draft-vocab",
        "full",
        "--json",
    ]


def launch_env(**extra: str) -> dict:
    """This process's environment with only the test run's XLA flags (the launcher adds each process's
    device count) and without ``SSD_JAX_CPUS``, plus ``extra``."""
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    env.pop("SSD_JAX_CPUS", None)
    env.update(extra)
    return env


def tokens(res) -> list[list[int]]:
    """Token ids per output of a run's JSON (a dict) or of a ``GenerationResult``."""
    outs = res["outputs"] if isinstance(res, dict) else res.outputs
    return [o["token_ids"] for o in outs]
