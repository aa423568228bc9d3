"""The methods the engine runs: AR (:mod:`.base`), SD on one device, stage by stage and on two meshes
(:mod:`.sd`), and SSD (:mod:`.ssd`). :func:`build_method` picks one for a validated spec."""

from __future__ import annotations


def build_method(model, spec, modes, load, trace=None, ar_rounds: bool = False):
    """The method object for ``spec`` (validated, K an integer) and the sampling ``modes`` its rounds
    may run in; ``load`` loads a draft by name. ``ar_rounds``: the plan runs AR rounds and ``spec``'s
    method has none of its own (:class:`.base.ARRounds`: the target's AR method under its name)."""
    from ssd_jax.engine.methods.base import AR, ARRounds

    if spec.method == "ar":
        return AR(model, modes)
    if ar_rounds:
        return ARRounds(model, modes, spec)
    spans = spec.target_devices is not None or spec.draft_devices is not None
    if spec.method == "sd":
        from ssd_jax.engine.methods.eagle import SDEagle, is_eagle, load_eagle

        if is_eagle(spec.draft):
            if spans or spec.profile_stages:
                from ssd_jax.errors import UserError

                raise UserError(
                    "an EAGLE head runs on the target's device, one call a round (no meshes, no stages)"
                )
            return SDEagle(model, modes, spec, *load_eagle(model, spec.draft), spec.draft)
        from ssd_jax.drafters import make_drafter
        from ssd_jax.engine.methods import sd
        from ssd_jax.sampling.filters import SamplingParams

        drafter = make_drafter(spec, model, SamplingParams(temperature=1.0, top_k=1), load)
        if drafter.kind == "model" and spans:  # a draft model on a mesh of its own
            from ssd_jax.errors import UserError
            from ssd_jax.parallel.placement import place

            if spec.profile_stages:
                raise UserError(
                    "--profile-stages times SD's stages on one device; with --target-devices / --draft-devices "
                    "each round is one draft call and one target call (use SSD's --trace for a timeline)"
                )

            return sd.SDTwoMeshes(place(model, drafter.model, spec), modes, spec, drafter)
        return (sd.SDProfiled if spec.profile_stages else sd.SD)(model, modes, spec, drafter)
    from ssd_jax.engine.methods.eagle import is_eagle, load_eagle

    if is_eagle(spec.draft):
        if spans or spec.profile_stages or trace:
            from ssd_jax.errors import UserError

            raise UserError(
                "SSD with an EAGLE head runs on the target's device, one call a round (no meshes, stages or trace yet)"
            )
        from ssd_jax.engine.methods.eagle_ssd import SSDEagle

        return SSDEagle(model, modes, spec, *load_eagle(model, spec.draft), spec.draft)
    from ssd_jax.drafters.base import check_same_tokenizer
    from ssd_jax.engine.methods.ssd import SSD
    from ssd_jax.parallel.placement import place

    draft = load(spec.draft) if isinstance(spec.draft, str) else spec.draft
    check_same_tokenizer(model, draft)
    return SSD(place(model, draft, spec), modes, spec, trace_path=trace)
