"""``nlmserve.__main__``: ``python -m nlmserve`` (as ``torchrun ... -m nlmserve train --distributed`` runs it)."""

import sys

from .cli import main

sys.exit(main())
