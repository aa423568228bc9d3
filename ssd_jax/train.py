"""Shim: ``python -m ssd_jax.train`` runs :func:`ssd_jax.cli.train.main`; training is :mod:`ssd_jax.training`."""

import sys

from ssd_jax.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
