import sys

from ssd_jax.decode import main

sys.exit(main())
