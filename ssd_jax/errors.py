"""User-facing errors.

Anything the user can fix (a bad flag, a missing file, a checksum mismatch) raises
:class:`UserError`. The CLIs catch it, print one line to stderr and exit with status 2.
"""


class UserError(Exception):
    """An error caused by the user's input; reported as one line, exit status 2."""

    exit_code = 2
