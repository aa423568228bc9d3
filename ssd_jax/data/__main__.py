"""Shim: ``python -m ssd_jax.data`` runs :func:`ssd_jax.cli.data.main`."""

import sys

from ssd_jax.cli.data import main

if __name__ == "__main__":
    sys.exit(main())
