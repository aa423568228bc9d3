"""``python -m ssd_jax.demo`` (``make demo``): the three commands it runs and its table (no models run here;
the demo itself runs as ``make demo`` on a fresh clone)."""

import argparse

from ssd_jax.cli import demo


def _res(tokens, **m):
    base = {"decode_tokens_per_s": 10.0, "tokens_per_s": 8.0}
    return {"outputs": [{"token_ids": tokens, "text": "x"}], "metrics": {**base, **m}}


def test_the_table_says_which_methods_match_ar_and_what_each_plan_chose():
    sd_plan = {"chosen": {"k": 3}, "choice": "sd K=3 (predicted 1.40x)"}
    declined = {"chosen": {"k": 1, "ar_rounds": True}, "choice": "AR rounds (predicted 0.59x)"}
    rows = demo.table(
        {
            "ar": _res([1, 2, 3]),
            "sd": _res([1, 2, 3], draft="d", acceptance_rate=0.5, plan=sd_plan),
            "ssd": _res([1, 2, 4], draft="d", acceptance_rate=0.25, cache_hit_rate=0.75),
            "ssd-declined": _res(
                [1, 2, 3], draft="d", acceptance_rate=0.0, cache_hit_rate=0.0, plan=declined
            ),
        }
    ).splitlines()
    assert rows[0].startswith("| method | draft | plan |")
    assert rows[2].startswith("| ar | - | - | 10.0 | 8.0 | - | - | - |")
    assert rows[3].startswith("| sd | d | sd K=3 (predicted 1.40x) |") and rows[3].endswith(
        "| 0.50 | - | yes |"
    )
    assert rows[4].endswith("| 0.25 | 0.75 | NO |")
    # a plan that ran AR rounds: its choice and reason; nothing proposed, so no acceptance or hit rate
    assert rows[5].startswith("| ssd-declined | d | AR rounds (predicted 0.59x) |")
    assert rows[5].endswith("| - | - | yes |")


def test_ssd_runs_its_draft_in_a_process_of_its_own(monkeypatch):
    monkeypatch.setattr(demo.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    args = argparse.Namespace(target="smollm2-135m-instruct", prompt="p", tokens=4)
    cmds = demo._commands(args)
    assert cmds["ar"][2:4] == ["ssd_jax.decode", "--target"] and "--method" not in cmds["ar"]
    assert cmds["sd"][cmds["sd"].index("--draft") + 1] == "smollm2-135m-eagle"
    ssd = cmds["ssd"]
    assert ssd[ssd.index("--draft") + 1] == "smollm2-135m-draft"
    assert ssd[ssd.index("--draft-devices") + 1] == "1"
    assert ssd[2:6] == ["ssd_jax.launch", "--processes", "2", "--cpus-per-process"]


def test_a_launched_ssd_that_does_not_pay_runs_again_in_one_process_on_every_core(monkeypatch, capsys):
    """SSD's launched layout is predicted below AR on both cores (its plan's ``ar_reference``): the
    demo runs SSD again in one process on both, under that layout's own plan, and names both choices."""
    ref = {"cores": 2, "t_ar": 0.02, "source": "cache", "expected_speedup": 0.87, "pays": False}
    launched = {
        "chosen": {"k": 1},
        "predicted": {"ar_reference": ref},
        "choice": "ssd K=1 budget=6 (predicted 1.27x)",
        "line": "plan: ssd K=1",
    }
    one = {"chosen": {"k": 1, "ar_rounds": True}, "choice": "AR rounds (predicted 0.70x)"}
    ran = []

    def fake_run(cmd):
        ran.append(cmd)
        if "--method" not in cmd:
            return _res([1, 2, 3])
        method = cmd[cmd.index("--method") + 1]
        if method == "sd":
            return _res([1, 2, 3], draft="e", plan={"chosen": {"k": 1}, "choice": "sd K=1"})
        return _res([1, 2, 3], draft="d", plan=launched if "ssd_jax.launch" in cmd else one)

    monkeypatch.setattr(demo.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(demo, "_run", fake_run)
    assert demo.run(["--tokens", "4"]) == 0
    assert len(ran) == 4 and "ssd_jax.launch" in ran[2] and "ssd_jax.launch" not in ran[3]
    row = capsys.readouterr().out.splitlines()
    ssd = next(r for r in row if r.startswith("| ssd |"))
    want = (
        "AR rounds (predicted 0.70x), one process (on its own core: ssd K=1 budget=6 (predicted 1.27x), 0.87x"
    )
    assert want in ssd
    # a launched layout predicted to pay, or a run without the whole-machine price, is the row as it ran
    for predicted in ({"ar_reference": {**ref, "pays": True}}, {}):
        launched["predicted"] = predicted
        ran.clear()
        assert demo.run(["--tokens", "4"]) == 0 and len(ran) == 3
