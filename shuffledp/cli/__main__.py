"""`python -m shuffledp.cli`: the same as the `shuffledp` command."""

import sys

from shuffledp.cli import main

sys.exit(main())
