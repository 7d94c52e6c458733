"""`python -m megatrain ...` is the `megatrain` console script."""

import sys

from megatrain.cli import main

sys.exit(main())
