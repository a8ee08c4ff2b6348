"""nlmserve: a neural language-model feature server for phrase-based SMT.

Import path: ``nlmserve`` (folder ``common/``; ``nlmserve.errors`` is ``common/errors.py``).
The rooms: ``nlmserve.lm`` (``lm/``), ``nlmserve.server`` (``server/``), ``nlmserve.client``
(``client/``), ``nlmserve.moses_plugin`` (``moses_plugin/``), ``nlmserve.proto``
(``gen/proto/``, generated from ``proto/``); the README's Layout table has them all.
"""

__version__ = "0.1.0"
