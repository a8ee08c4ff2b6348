"""``python -m nlmserve`` (what ``torchrun ... -m nlmserve train --distributed`` runs)."""

import sys

from nlmserve.cli import main

sys.exit(main())
