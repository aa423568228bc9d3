"""``python -m ssd_jax.demo``: AR, SD and SSD on the default pair in one table (:mod:`ssd_jax.cli.demo`)."""

import sys

from ssd_jax.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
