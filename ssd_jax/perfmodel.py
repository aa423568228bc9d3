"""Shim: ``python -m ssd_jax.perfmodel`` runs :func:`ssd_jax.cli.perfmodel.main`; the model is
:mod:`ssd_jax.analysis.perfmodel`."""

import sys

from ssd_jax.cli.perfmodel import main

if __name__ == "__main__":
    sys.exit(main())
