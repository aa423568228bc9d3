"""``ssd_jax.perf``: the performance model under the name the benchmark issue uses.

Everything lives in :mod:`ssd_jax.perfmodel`; ``python -m ssd_jax.perf`` is
``python -m ssd_jax.perfmodel``.
"""

import sys

from ssd_jax.perfmodel import *  # noqa: F401,F403
from ssd_jax.perfmodel import main

if __name__ == "__main__":
    sys.exit(main())
