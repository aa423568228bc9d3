"""Shim: ``python -m ssd_jax.bench`` runs :func:`ssd_jax.cli.bench.main`."""

import sys

from ssd_jax.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
