"""User-facing errors, and how the CLIs report.

Anything the user can fix (a bad flag, a missing file, a checksum mismatch) raises
:class:`UserError`. The CLIs catch it, print one line to stderr and exit with status 2.

The library logs through ``logging.getLogger(__name__)`` and configures nothing: an embedding
application routes, formats or silences the ``ssd_jax`` loggers as it likes (with no configuration at
all, Python's last-resort handler shows warnings on stderr). The CLIs and the server configure one
handler (:func:`configure_logging`, ``--log-level``): each record on stderr as its message alone, so
the lines keep the prefixes they always had (``[plan] ...``, ``[serve] ...``, ``warning: ...``).
"""

from __future__ import annotations

import logging
import sys

#: the ``--log-level`` choices, quietest last
LOG_LEVELS = ("debug", "info", "warning", "error")


class UserError(Exception):
    """An error caused by the user's input; reported as one line, exit status 2."""

    exit_code = 2


class _Stderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is when each record is emitted, not as it was when
    the handler was made (pytest's capture, for one, swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def configure_logging(level: str = "info") -> None:
    """The CLIs' one handler on the ``ssd_jax`` loggers: records at ``level`` and above, on stderr, each
    as its message alone (the lines keep their prefixes). Called again, it replaces its handler, so the
    level a CLI parses overrides the default :func:`cli_main` set."""
    root = logging.getLogger("ssd_jax")
    for h in [h for h in root.handlers if isinstance(h, _Stderr)]:
        root.removeHandler(h)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False  # the one handler: an application's root handlers would print each line twice


def cli_main(run, argv=None) -> int:
    """Run a CLI entry point: a UserError becomes one line on stderr and its exit status. JAX's
    persistent compilation cache is turned on first (:func:`ssd_jax.compile.use_persistent_cache`), and
    the log handler at info (a CLI's ``--log-level`` changes it: :func:`ssd_jax.cli.args.add_log_level`)."""
    from ssd_jax.compile import use_persistent_cache

    configure_logging()
    use_persistent_cache()
    try:
        return run(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
