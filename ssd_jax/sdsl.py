"""Shim: ``python -m ssd_jax.sdsl`` runs :func:`ssd_jax.cli.sdsl.main`; the law is :mod:`ssd_jax.analysis.sdsl`."""

import sys

from ssd_jax.cli.sdsl import main

if __name__ == "__main__":
    sys.exit(main())
