"""nlmserve: a neural language-model feature server for phrase-based SMT.

The repository's root is the package: ``nlmserve.X`` is the folder ``X/`` (``nlmserve.wire.ngrams``
is ``wire/ngrams.py``, ``nlmserve.common.errors`` is ``common/errors.py``); the rooms import each
other relatively (``from ..wire import ngrams``). docs/architecture.md has the rooms.
"""

__version__ = "0.1.0"
