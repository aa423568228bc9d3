"""Probes (anecdotes) of the Qwen 0.5B draft (bfloat16, 32,768-token head) at batch 16, for
experiments/results/qwen_b16_stages.md:

    python experiments/draft_stage_probes.py prefill|propose|context
"""
import sys

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "prefill"
    path = {"prefill": "prefill", "propose": "prop", "context": "ctx"}[which]
    sys.argv = sys.argv[:1]
    import runpy
    runpy.run_path(__file__.replace("draft_stage_probes.py", f"_draft_{path}_probe.py"), run_name="__main__")
