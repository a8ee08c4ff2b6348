"""The experiments' tests import the helpers of the product's tests (``tests/support.py``: the
golden model, the tiny ARPA file). They run apart from ``make test``:

    .venv/bin/pytest experiments/tests
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
