"""User-facing errors.

Anything the user can fix (a bad flag, a missing file, a checksum mismatch) raises
:class:`UserError`. The CLIs catch it, print one line to stderr and exit with status 2.
"""


class UserError(Exception):
    """An error caused by the user's input; reported as one line, exit status 2."""

    exit_code = 2


def cli_main(run, argv=None) -> int:
    """Run a CLI entry point: a UserError becomes one line on stderr and its exit status. JAX's
    persistent compilation cache is turned on first (:func:`ssd_jax.compile.use_persistent_cache`)."""
    import sys

    from ssd_jax.compile import use_persistent_cache

    use_persistent_cache()
    try:
        return run(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
