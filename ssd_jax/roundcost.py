"""``python -m ssd_jax.roundcost``: the round-cost benchmark (:mod:`ssd_jax.cli.roundcost`)."""

import sys

from ssd_jax.cli.roundcost import main

if __name__ == "__main__":
    sys.exit(main())
