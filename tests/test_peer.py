"""The HF peer path (tools/hf_compare.py) under the protocol: HF generate and prompt lookup
interleaved with our AR on the same tiny checkpoint, with the decode-only split; tokens equal."""

import importlib.util
from pathlib import Path

import pytest

from ssd_jax.bench import protocol

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "hf_compare.py"


def test_hf_runners_interleave_with_ours(tmp_path, tiny_llama_path):
    pytest.importorskip("transformers")
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM

    import ssd_jax

    spec = importlib.util.spec_from_file_location("hf_compare", SCRIPT)
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    ours = ssd_jax.load_model(tiny_llama_path)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()
    runners = {
        "ar": protocol.EngineRunner(ours, protocol.method_specs(["ar"])["ar"]),
        "hf-generate": hf.HFRunner(theirs),
        "hf-prompt-lookup-2": hf.HFRunner(theirs, prompt_lookup_num_tokens=2),
    }
    recs = {"code": [{"id": "a", "prompt": [3, 17, 29, 3, 17]}, {"id": "b", "prompt": [5, 6, 7, 5, 6, 7]}]}
    path = protocol.run_protocol(
        runners,
        protocol.build_units(recs, 2, 1),
        tmp_path / "peer.jsonl",
        repeats=1,
        new_tokens=6,
        progress=False,
    )
    rows = [r for r in protocol.read_rows(path) if r["kind"] == "run"]
    assert len(rows) == 6
    for r in rows:
        assert r["generated_tokens"] == 6 and 0 < r["ttft_s"] < r["wall_s"] and r["decode_tok_s"] > 0
    summ = {s["method"]: s for s in protocol.summarize(rows, "hf-generate") if s["category"] == "all"}
    assert summ["hf-generate"]["same_tokens_as_ar"] == 1.0  # same checkpoint, greedy: HF's tokens are ours
    assert summ["hf-generate"]["decode_tok_s_vs_base"][0] == pytest.approx(1.0)
    md = protocol.write_report(path, "peer", bases=("ar", "hf-generate")).read_text()
    assert "# Against hf-generate" in md
