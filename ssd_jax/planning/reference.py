"""AR on every core, beside SSD's plan when its processes split the machine's cores.

Under ``python -m ssd_jax.launch --cpus-per-process N`` SSD's target computes on its own cores and the
draft on others: that is how the draft gets hardware of its own. Inside the run the choice is SSD or AR
rounds on the target's cores, and the plan makes it against AR there. Whether the layout itself pays
is another question: AR in one process could have *every* core the launcher gave out (the second
comparison of the hardware-fair protocol, docs/benchmarking.md). On the 2-core CPU SmolLM2's step is
29 ms on one core and 20 ms on two, so SSD predicted at 1.27x AR on its core (and measured at that, 43.9
tok/s) is 0.87x AR on both: the demo showed it at 0.95x AR (issue 54,
experiments/results/issue54/demo_avx2.txt). :func:`layout_check` puts that comparison in the plan
(``predicted.ar_reference``, and its line); the demo runs SSD in one process where it fails.

A pinned process cannot time the whole machine (XLA sized its thread pool when it started), so process
0 reads the step from the cache, or times it once in a child process of its own on all the launcher's
cores (the child widens its affinity before ``import ssd_jax`` pins it, then times the target's
``t_ar`` at the run's batch) while the other processes wait at a barrier; every process then takes
process 0's value (:func:`agreed_step`). The launcher names the cores in ``$SSD_JAX_MACHINE_CPUS``.
"""

from __future__ import annotations

import logging
import json
import os
import subprocess
import sys

log = logging.getLogger(__name__)

#: the cores the launcher had, given to every process it starts (``ssd_jax.cli.launch``)
MACHINE_CPUS_ENV = "SSD_JAX_MACHINE_CPUS"
#: seconds the child measurement may take (it loads the target and compiles its decode step)
CHILD_TIMEOUT_S = 900
#: the launcher's variables a child on its own must not inherit (it is one process, not one of several)
#: the child's program: it widens its cores to the machine's (it inherits process 0's) before
#: ``import ssd_jax`` pins it to ``$SSD_JAX_CPUS``, then runs :func:`main`
CHILD = "import os, sys; os.sched_setaffinity(0, {cores}); sys.argv[1:] = {args!r}; " + (
    "from ssd_jax.planning.reference import main; sys.exit(main())"
)
_LAUNCH_VARS = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    MACHINE_CPUS_ENV,
    "SSD_JAX_LINK_SECRET",  # the link's secret (ssd_jax.parallel.link): the child needs no link
)


def machine_cores() -> list[int] | None:
    """The launcher's cores (``$SSD_JAX_MACHINE_CPUS``), or None when not launched with them."""
    from ssd_jax.xla_env import parse_cpus

    text = os.environ.get(MACHINE_CPUS_ENV, "").strip()
    try:
        return parse_cpus(text) if text else None
    except ValueError:
        return None


def needed() -> bool:
    """Whether this process computes on fewer cores than the machine AR would run on (a CPU process
    pinned by the launcher): SSD's speedup is then priced against :func:`agreed_step`."""
    import jax

    from ssd_jax.xla_env import PINNED

    cores = machine_cores()
    return bool(PINNED and cores and len(cores) > len(PINNED) and jax.devices()[0].platform == "cpu")


def child_env(cores: list[int]) -> dict:
    """The environment of a child that runs alone on ``cores``: no launcher variables, one CPU device."""
    from ssd_jax.xla_env import CPUS_ENV

    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env[CPUS_ENV] = ",".join(map(str, cores))
    env["SSD_JAX_KAUTO_RECALIBRATE"] = "1"  # timed now, not an older target-costs record (made under load?)
    flags = [
        f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def machine_step(model, batch: int) -> dict:
    """``{"t_ar", "cores", "source", "cache_file"}``: the target's one-token step at ``batch`` rows on every
    core of :func:`machine_cores`, from the cache or timed once in a child process."""
    from ssd_jax.errors import UserError
    from ssd_jax.planning.records import fingerprint, kauto_dir, machine_fields, read_json, write_atomic

    cores = machine_cores() or []
    fields, key = machine_fields(
        kind="ar-reference", target=fingerprint(model), batch=batch, cores=len(cores)
    )
    path = kauto_dir() / f"{key}.json"
    if not os.environ.get("SSD_JAX_KAUTO_RECALIBRATE") and (rec := read_json(path)) is not None:
        return {
            "t_ar": float(rec["costs"]["t_ar"]),
            "cores": len(cores),
            "source": "cache",
            "cache_file": str(path),
        }
    dtype = str(model.params["embed"].dtype) if "embed" in model.params else "float32"
    args = [model.source, "--dtype", dtype, "--batch", str(batch)]
    cmd = [sys.executable, "-c", CHILD.format(cores=set(cores), args=args)]
    log.info(f"[plan] timing AR on all {len(cores)} cores once (a child process) ...")
    try:
        p = subprocess.run(cmd, env=child_env(cores), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        t_ar = float(json.loads(p.stdout.strip().splitlines()[-1])["t_ar"]) if p.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError, KeyError) as e:
        raise UserError(f"timing AR on all {len(cores)} cores failed ({type(e).__name__})") from None
    if t_ar is None:
        tail = " | ".join([ln for ln in p.stderr.splitlines() if ln.strip()][-2:])
        raise UserError(f"timing AR on all {len(cores)} cores failed (exit {p.returncode}): {tail}")
    write_atomic(path, {**fields, "costs": {"t_ar": t_ar}})
    return {"t_ar": t_ar, "cores": len(cores), "source": "measured", "cache_file": str(path)}


def agreed_step(model, batch: int) -> dict:
    """:func:`machine_step` as process 0 has it, in every process (the others wait while it measures)."""
    from ssd_jax.parallel.distributed import agree, is_main

    ref = (
        machine_step(model, batch)
        if is_main()
        else {"cores": len(machine_cores() or []), "source": "process 0"}
    )
    ref["t_ar"] = agree(int(round(ref.get("t_ar", 0.0) * 1e7))) / 1e7  # 0.1 us steps: int32 up to 214 s
    return ref


def layout_check(model, batch: int, t_own: float, plan: dict) -> dict:
    """SSD's launched layout against AR on every core (:func:`agreed_step`): ``expected_speedup`` is what
    this run is predicted to make (its best plan where that beats AR on its own cores by the planner's
    margin, else its AR rounds) over AR on all of them; ``pays``: above that AR by the margin too. The
    run's own choice stays against AR on its cores (what it runs instead); a launcher or the demo chooses
    the layout by ``pays`` (``line`` says it in the plan's line)."""
    from ssd_jax.planning.policy import SERVING_MARGIN, beats_ar

    ref = agreed_step(model, batch)
    own = plan["expected_speedup"] if beats_ar(plan["expected_speedup"]) else 1.0
    whole = own * ref["t_ar"] / max(t_own, 1e-12)
    ref.update(expected_speedup=round(whole, 4), pays=beats_ar(whole))
    verdict = (
        ""
        if ref["pays"]
        else (
            f": not above it by the planner's {SERVING_MARGIN:.0%}, AR in one process on them is expected faster"
        )
    )
    ref["line"] = (
        f"vs AR on all {ref['cores']} cores (t_ar {1e3 * ref['t_ar']:.2f} ms, {ref['source']}) "
        f"predicted {whole:.2f}x{verdict}"
    )
    return ref


def main(argv=None) -> int:
    """The child: load the target, print its step on this process's cores as one JSON line."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ssd_jax.planning.reference", description=main.__doc__)
    p.add_argument("target")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=1)
    a = p.parse_args(argv)
    from ssd_jax.loading import load_model
    from ssd_jax.planning.records import Calibrator
    from ssd_jax.xla_env import cpus

    cal = Calibrator(load_model(a.target, dtype=a.dtype)).target_costs(a.batch)
    print(json.dumps({"t_ar": cal.costs.t_ar, "cpus": len(cpus()), "source": cal.source}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
