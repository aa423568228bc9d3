"""The argument parser every ``python -m ssd_jax.<tool>`` command uses."""

from __future__ import annotations

import argparse
import sys

__all__ = ["Parser"]


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the project's CLI convention for bad input: one line
    ``error: <message>`` on stderr and exit status 2 (argparse would print the usage block too).

    Sub-command parsers made by :meth:`add_subparsers` are of this class as well.
    """

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)
