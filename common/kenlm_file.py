"""``nlmserve.common.kenlm_file``: a Kneser-Ney model (ARPA or KenLM binary), read with ``kenlm``.

``kenlm`` (PyPI) is not a runtime dependency; it is in the ``bench`` and ``dev`` extras.
Everything that reads such a file (``nlmserve eval --kenlm``, ``nlmserve rescore --kenlm``,
the benchmarks) goes through :func:`load_kenlm`, so the errors are the same everywhere.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import InputError


def load_kenlm(path: str | os.PathLike[str]) -> Any:
    """A ``kenlm.Model`` (ARPA or binary); InputError naming the file when it cannot be read."""
    try:
        import kenlm
    except ImportError as exc:
        raise InputError("reading a Kneser-Ney model needs the kenlm module: pip install 'nlmserve[bench]' "
                         "(or pip install kenlm)", str(path)) from exc
    if not os.path.exists(path):
        raise InputError("no such Kneser-Ney model file", str(path))
    if os.path.isdir(path):
        raise InputError("a directory, not a Kneser-Ney model file", str(path))
    try:
        return kenlm.Model(str(path))
    except (OSError, RuntimeError, ValueError) as exc:
        raise InputError(f"cannot read the Kneser-Ney model: {exc}", str(path)) from exc
