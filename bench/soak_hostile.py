"""What the soak's hostile clients share (bench/soak_attacks.py, bench/soak_h2_attacks.py):
the attacks by name, what they hold and send (:class:`HostileConfig`), a replica as they see
it, and what each got."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("bench.soak")

REPO = Path(__file__).resolve().parent.parent
SERVICE = "/nlmserve.v1.LanguageModel/"
SCORE = SERVICE + "ScoreNgrams"
METHODS = (SCORE, SERVICE + "ScoreSentences", SERVICE + "GetModelInfo")
CHECK = "/grpc.health.v1.Health/Check"
STREAMING = (SERVICE + "GetScoringTables", SERVICE + "GetVocabulary")

#: An empty gRPC message (uncompressed, length 0): the request of GetVocabulary and GetScoringTables.
EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"

#: Every attack by the name ``--attacks`` takes, with what the report calls it.
ATTACKS: dict[str, str] = {
    "watch": "health Watch streams, one per connection",
    "watch_flood": "health Watch streams, 8 per connection, beyond --max-health-watches",
    "half_open": "ScoreNgrams calls that never send their message",
    "half_open_health": "health Check calls that never send their message, 8 per connection, beyond "
                        "--max-health-watches",
    "garbage": "random bytes and oversized messages on three methods",
    "gzip_bomb": "gzip-compressed requests that inflate to --gzip-bomb-bytes",
    "deadline_1ms": "ScoreNgrams with a 1 ms deadline, with a token",
    "invented_methods": "calls of invented method names",
    "never_read": "server-streaming calls and ScoreNgrams answers whose client never reads, with a token",
    "rapid_reset": "HEADERS + RST_STREAM bursts on one connection",
    "big_metadata": "half-open calls with large metadata",
    "slow": "connections that stop before their preface ends or inside a header block",
    "raw_tcp": "TCP connections of random bytes",
    "vanishing": "clients killed with large requests in flight, with a token",
}


@dataclass(frozen=True)
class HostileConfig:
    """What the hostile clients hold and send, per replica (the soak's defaults first).

    Fields:
        attacks: the attacks that run (names of :data:`ATTACKS`).
        watch_per_connection: health Watch streams on each flood connection (the servers'
            per-connection default); the flood opens ``max_health_watches // this + 2``
            connections, so that it asks for more than the pool holds.
        never_read_connections: connections of the token holder that never reads.
        never_read_calls: calls it keeps open on each (at most what the server's
            SETTINGS_MAX_CONCURRENT_STREAMS allows): GetScoringTables, GetVocabulary and, with
            ``never_read_unary``, ScoreNgrams of 100 n-grams, in turn.
        never_read_unary: whether ScoreNgrams is among them (its answer waits unread).
        reset_burst: HEADERS + RST_STREAM pairs in one burst of the rapid-reset client.
        reset_every: seconds between its bursts.
        big_metadata_calls: half-open calls with large metadata held at once, one
            connection each; half send ``big_metadata_bytes`` before acknowledging the
            server's SETTINGS, half send what the server's SETTINGS_MAX_HEADER_LIST_SIZE
            accepts after acknowledging them.
        big_metadata_bytes: metadata of the first half, bytes.
        gzip_bomb_bytes: what a gzip-compressed request inflates to (its zeros compress
            about 1,000 to 1).
        gzip_every: seconds between two bombs (one without and one with a token).
        deadline_calls: concurrent 1 ms-deadline calls in each round (a round every 0.1 s).
        invented_methods: invented method names called in all (half with a token), at
            most 50 a second.
        slow_connections: connections held of each slow kind (silent, stopped inside the
            preface, stopped inside a header block).
        vanish_every: seconds between two vanishing clients (alternating replicas).
        vanish_calls: calls a vanishing client has in flight when it is killed.
        vanish_ngrams: n-grams in each of them.
    """

    attacks: tuple[str, ...] = tuple(ATTACKS)
    watch_per_connection: int = 8
    never_read_connections: int = 3
    never_read_calls: int = 100
    never_read_unary: bool = True
    reset_burst: int = 10_000
    reset_every: float = 5.0
    big_metadata_calls: int = 64
    big_metadata_bytes: int = 1024 * 1024
    gzip_bomb_bytes: int = 64 * 1024 * 1024
    gzip_every: float = 5.0
    deadline_calls: int = 5
    invented_methods: int = 5_000
    slow_connections: int = 100
    vanish_every: float = 20.0
    vanish_calls: int = 100
    vanish_ngrams: int = 100_000

    def __post_init__(self) -> None:
        unknown = sorted(set(self.attacks) - set(ATTACKS))
        if unknown:
            raise ValueError(f"unknown attacks {', '.join(unknown)}; known: {', '.join(ATTACKS)}")


class Target(Protocol):
    """A replica as the attackers see it: its name, public port and whether it is up."""

    name: str
    port: int
    up: threading.Event


@dataclass
class Tally:
    """What one attack got: counts by outcome, and seconds until the server let go of what
    it held (a list per kind of hold)."""

    counts: Counter[str] = field(default_factory=Counter)
    held: dict[str, list[float]] = field(default_factory=dict)

    def hold(self, kind: str, seconds: float) -> None:
        self.held.setdefault(kind, []).append(seconds)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(sorted(self.counts.items()))
        for kind, values in sorted(self.held.items()):
            values = sorted(values)
            out[f"{kind}_s_p50"] = round(values[len(values) // 2], 1)
            out[f"{kind}_s_max"] = round(values[-1], 1)
        return out


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Returns after ``seconds``, or as soon as ``stop`` is set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass
