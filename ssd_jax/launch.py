"""``python -m ssd_jax.launch``: several JAX processes on one machine (:mod:`ssd_jax.cli.launch`)."""

import sys

from ssd_jax.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
