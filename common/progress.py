"""``nlmserve.common.progress``: progress on stderr, a tqdm bar on a terminal, a log line elsewhere.

tqdm redraws its bar with carriage returns; written into a file (stderr redirected, a
container's log, a CI job) every redraw stays in it. So the bar is drawn only when the
stream is a terminal; otherwise the same calls (``update``, ``set_postfix``, ``close``,
``with``) write an ordinary log record at most every ``LOG_SECONDS`` seconds, and one at
the end::

    with progress(total=1000, unit="step", desc="train", logger=log) as bar:
        bar.set_postfix(loss="4.123", refresh=False)
        bar.update(1)

    2025-01-01 12:00:30 INFO nlmserve.lm.train: train: 412/1,000 step (41%), loss 4.123
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

# Seconds between two log lines when the stream is not a terminal.
LOG_SECONDS = 30.0


class LogLines:
    """tqdm's surface, as log records: counts units, keeps the last postfix, and logs the
    count, the total and the postfix when ``min_seconds`` have passed since the last record."""

    def __init__(self, logger: logging.Logger, desc: str, unit: str, total: int | None, initial: int,
                 min_seconds: float) -> None:
        self.logger, self.desc, self.unit, self.total = logger, desc, unit, total
        self.n = initial
        self.min_seconds = min_seconds
        self.postfix: dict[str, Any] = {}
        self._last = time.monotonic()
        self._unlogged = False

    def update(self, n: int = 1) -> None:
        self.n += n
        self._unlogged = True
        if time.monotonic() - self._last >= self.min_seconds:
            self.log_line()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = values

    def log_line(self) -> None:
        count = f"{self.n:,}/{self.total:,} {self.unit}" if self.total else f"{self.n:,} {self.unit}"
        if self.total:
            count += f" ({100 * self.n / self.total:.0f}%)"
        self.logger.info("%s: %s", self.desc, ", ".join([count, *(f"{k} {v}" for k, v in self.postfix.items())]))
        self._last = time.monotonic()
        self._unlogged = False

    def close(self) -> None:
        if self._unlogged:
            self.log_line()

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(*, desc: str, unit: str, logger: logging.Logger, total: int | None = None, initial: int = 0,
             enabled: bool = True, stream: TextIO | None = None, min_seconds: float | None = None,
             leave: bool = True) -> Any:
    """A tqdm bar on ``stream`` (default stderr) when it is a terminal, else :class:`LogLines`
    logging to ``logger`` every ``min_seconds`` (default ``LOG_SECONDS``); nothing when not
    ``enabled``."""
    if not enabled:
        return _Silent()
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit=unit, desc=desc, file=stream, dynamic_ncols=True, leave=leave)
    return LogLines(logger, desc, unit, total, initial, LOG_SECONDS if min_seconds is None else min_seconds)


__all__ = ["LOG_SECONDS", "LogLines", "progress"]
