"""``python -m ssd_jax.decode``: the decoding CLI (:mod:`ssd_jax.cli.decode`)."""

import sys

from ssd_jax.cli.decode import main

if __name__ == "__main__":
    sys.exit(main())
