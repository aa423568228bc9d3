"""Shim: ``python -m ssd_jax.perfmodel`` runs :func:`ssd_jax.cli.perfmodel.main`; the model is
:mod:`ssd_jax.analysis.perfmodel`. (The three names below stay importable from here until
``ssd_jax/ssd.py`` imports them from ``ssd_jax.analysis.perfmodel``.)"""

import sys

from ssd_jax.analysis.perfmodel import ModelShape, forward_time, hardware_for_device  # noqa: F401
from ssd_jax.cli.perfmodel import main

if __name__ == "__main__":
    sys.exit(main())
