import sys

from ssd_jax.cli.decode import main

sys.exit(main())
