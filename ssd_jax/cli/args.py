"""The argument parser every ``python -m ssd_jax.<tool>`` command uses, and the model and speculation flags
that ``decode`` and ``serve`` share."""

from __future__ import annotations

import argparse
import sys

DEFAULT_TARGET = "smollm2-135m-instruct"

__all__ = ["Parser", "add_log_level", "add_model_args", "add_spec_args", "spec_from_args"]


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the project's CLI convention for bad input: one line
    ``error: <message>`` on stderr and exit status 2 (argparse would print the usage block too).

    Sub-command parsers made by :meth:`add_subparsers` are of this class as well.
    """

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):
        """Parsed as argparse does; where the command has ``--log-level``, the log handler is set to it
        before anything else runs."""
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "log_level", None):
            from ssd_jax.errors import configure_logging

            configure_logging(ns.log_level)
        return ns, rest


def add_log_level(p, help_extra: str = "") -> None:
    """``--log-level``: what the ``ssd_jax`` loggers show on stderr (info: the start-up lines and the
    plan too; warning: warnings and errors only)."""
    from ssd_jax.errors import LOG_LEVELS

    p.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="what is logged on stderr: info (default) shows the plan and the start-up lines, warning "
        "only warnings and errors" + help_extra,
    )


def add_model_args(p) -> None:
    """``--target`` and ``--dtype``."""
    g = p.add_argument_group("model")
    g.add_argument("--target", default=DEFAULT_TARGET, help="registry name, .gguf file or HF directory")
    g.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (accelerator default)")


def add_spec_args(p) -> None:
    """The speculation flags (``--method --draft --k ...``, the SSD ones and the meshes)."""
    g = p.add_argument_group("speculation")
    g.add_argument("--method", default="ar", help="ar | sd | ssd")
    g.add_argument("--draft", default=None, help="draft model name or path, 'ngram' or 'random'")
    g.add_argument(
        "--k",
        default="auto",
        help="speculative tokens per round: an integer >= 1, or 'auto' (default): "
        "chosen in 1..8 from a short calibration of this machine, cached under $SSD_JAX_CACHE/kauto",
    )
    g.add_argument("--prompt-lookup-min", type=int, default=1)
    g.add_argument("--prompt-lookup-max", type=int, default=4)
    g.add_argument(
        "--draft-vocab",
        type=_draft_vocab,
        default="auto",
        metavar="N|full|auto",
        help="keep only the N most frequent "
        "target tokens in the draft model's output head (counted once on the offline corpus, stored with "
        "the draft); exact, since q = 0 outside them. 'full': the whole head. 'auto' (default): the full "
        "head or a 32,768-token one, whichever this machine's calibration expects to be faster",
    )
    g.add_argument(
        "--draft-context",
        type=int,
        default=None,
        metavar="W",
        help="SD with a draft model: the draft prefills and sees only the last W prompt tokens (and what "
        "is generated); exact, it saves most of the draft's prefill on long prompts (default: the whole prompt)",
    )
    g.add_argument(
        "--draft-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="store the draft model's "
        "weight matrices in this dtype while it computes in the target's; exact either way. 'auto' "
        "(default): the target's dtype or bfloat16, whichever this machine's calibration expects to be "
        "faster (on CPU, bfloat16 under a float32 target halves what each draft step reads)",
    )
    g = p.add_argument_group("speculative speculative decoding (--method ssd)")
    g.add_argument(
        "--fan-out",
        default="geometric",
        help="branches per acceptance position: an integer, or "
        "'geometric' (Theorem 12, acceptance and miss exponent estimated online; default)",
    )
    g.add_argument(
        "--fan-out-budget",
        type=int,
        default=None,
        help="branches per sequence for geometric fan-out (default 2*(k+1))",
    )
    g.add_argument(
        "--saguaro-c",
        type=float,
        default=1.0,
        help="Saguaro down-weighting of cached tokens in "
        "the draft distribution, in [0, 1] (1 = plain sampling)",
    )
    g.add_argument(
        "--backup",
        default="auto",
        help="cache-miss fallback: neural | ngram | random | auto "
        "(neural below the critical batch size b*, n-gram above)",
    )
    g.add_argument("--target-devices", type=int, default=None, help="target mesh size (tensor parallel)")
    g.add_argument(
        "--draft-devices",
        type=int,
        default=None,
        help="draft mesh size (disjoint from the target's); without either flag both models share one device",
    )
    return g


def spec_from_args(args, paged: bool = False):
    """The :class:`SpecConfig` the flags ask for (the default draft of the target when SD / SSD has none;
    ``paged``: the server's, which pages its KV cache, so a draft model rather than a head)."""
    from ssd_jax.decoding.spec import SpecConfig

    if args.method in ("sd", "ssd") and args.draft is None:
        from ssd_jax.drafters import default_draft

        args.draft = default_draft(args.target, "model" if paged else args.method)
    return SpecConfig(
        method=args.method,
        draft=args.draft,
        k=_k_flag(args.k),
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        fan_out=args.fan_out if args.fan_out == "geometric" else _int_flag("--fan-out", args.fan_out),
        fan_out_budget=args.fan_out_budget,
        saguaro_c=args.saguaro_c,
        backup=args.backup,
        target_devices=args.target_devices,
        draft_devices=args.draft_devices,
        profile_stages=getattr(args, "profile_stages", False),
        draft_vocab=args.draft_vocab,
        draft_dtype=getattr(args, "draft_dtype", "auto"),
        draft_context=getattr(args, "draft_context", None),
    )


def _k_flag(value) -> int | str:
    from ssd_jax.errors import UserError

    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise UserError(f"--k must be an integer >= 1 or 'auto', got {value!r}") from None


def _int_flag(name, value) -> int:
    from ssd_jax.errors import UserError

    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name} must be an integer or 'geometric', got {value!r}") from None


def _draft_vocab(v: str):
    """--draft-vocab: an integer, 'full' (None: the whole head) or 'auto'."""
    if v in ("auto", "full"):
        return None if v == "full" else v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, 'full' or 'auto', got {v!r}") from None
