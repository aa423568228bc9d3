"""Shim: ``python -m ssd_jax.perf`` is ``python -m ssd_jax.perfmodel`` (:mod:`ssd_jax.cli.perfmodel`)."""

import sys

from ssd_jax.cli.perfmodel import main

if __name__ == "__main__":
    sys.exit(main())
