"""Decoding loops: the shared batch and row setup (:mod:`.batch`), the compiled-step runtime
(:mod:`.runtime`), plain autoregressive decoding (:mod:`.ar`), speculative decoding (:mod:`.sd`),
speculative speculative decoding (:mod:`.ssd`: speculation tree, fan-out, backup policy, round
loop), acceptance statistics (:mod:`.stats`) and the device timeline (:mod:`.trace`)."""
