"""Och's minimum error rate training on n-best lists, with an exact line search.

Data: each hypothesis is a dense feature vector and its BLEU sufficient statistics
(sacrebleu's, computed once, :mod:`nlmserve.moses_plugin.bleu`). n-best lists of several
decoder iterations are merged as mert-moses.pl does: the union of hypotheses per sentence.

Line search (Och 2003): along ``w + γ·d`` each hypothesis' model score is the line
``a + γ·b`` (``a = f·w``, ``b = f·d``). A sentence's 1-best is the upper envelope of
its lines; the envelope changes hypothesis at finitely many thresholds. Merging all
sentences' thresholds, sorting them and adding the statistics differences gives the
corpus statistics on every interval of γ exactly; BLEU is computed per interval by
sacrebleu and the midpoint of the best interval is taken. Directions are the
coordinate axes of the active features plus random directions; several random
restarts; the best point is L1-normalised, as Moses' ``mert`` reports it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..common.errors import InputError, NbestFormatError
from .bleu import N_STATS, SentenceStats, score_from_stats
from .nbest import NbestEntry, iter_sentences
from .weights import Layout, Weights

log = logging.getLogger(__name__)

# Half-width of the step taken into an unbounded best interval (γ units).
UNBOUNDED_STEP = 1.0


@dataclass
class MertData:
    """Hypotheses per sentence: features (K, d) float64 and statistics (K, 10) int64.

    Fields:
        layout: the dense feature layout shared by every hypothesis.
        feats / stats / hyps: per sentence id.
    """

    layout: Layout
    feats: dict[int, np.ndarray] = field(default_factory=dict)
    stats: dict[int, np.ndarray] = field(default_factory=dict)
    hyps: dict[int, list[str]] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return sum(n for _, n in self.layout)

    @property
    def n_hypotheses(self) -> int:
        return sum(len(f) for f in self.feats.values())

    def add(self, sent: int, feats: np.ndarray, stats: np.ndarray, hyps: Sequence[str]) -> int:
        """Append hypotheses (already known to be new) of sentence ``sent``; returns how many."""
        if sent not in self.feats:
            self.feats[sent], self.stats[sent], self.hyps[sent] = feats, stats, list(hyps)
        else:
            self.feats[sent] = np.vstack([self.feats[sent], feats])
            self.stats[sent] = np.vstack([self.stats[sent], stats])
            self.hyps[sent] = self.hyps[sent] + list(hyps)
        return len(hyps)


def select_features(data: MertData, names: Sequence[str]) -> MertData:
    """A copy of ``data`` with only the named feature groups (duplicates then merged)."""
    unknown = set(names) - {name for name, _ in data.layout}
    if unknown:
        raise InputError(f"no features {sorted(unknown)} in the data")
    layout = tuple(g for g in data.layout if g[0] in names)
    columns = _columns(data.layout, layout)
    out = MertData(layout)
    for sent in sorted(data.feats):
        feats = data.feats[sent][:, columns]
        new = _new_indices(out, sent, feats, data.stats[sent])
        out.add(sent, feats[new], data.stats[sent][new], [data.hyps[sent][i] for i in new])
    return out


def group_arrays(group: Sequence[NbestEntry], layout: Layout, path: str) -> np.ndarray:
    """The (K, d) feature matrix of one sentence's hypotheses, checking the layout."""
    rows = []
    for entry in group:
        if entry.layout() != layout:
            raise NbestFormatError(f"features {entry.layout()} differ from the list's {layout}", path, entry.line_no)
        rows.append(entry.dense_values())
    return np.asarray(rows, dtype=np.float64).reshape(len(group), sum(n for _, n in layout))


def load_nbest_data(
    paths: Sequence[str],
    scorer: SentenceStats,
    *,
    features: Sequence[str] | None = None,
    skip_bad: bool = False,
) -> MertData:
    """Read n-best lists (union per sentence) and compute each new hypothesis' statistics once.

    ``features`` restricts the dense groups used (names in list order); by default all.
    """
    data: MertData | None = None
    warned_sparse = False
    for path in paths:
        added = 0
        for group in iter_sentences(path, skip_bad=skip_bad):
            layout = group[0].layout()
            if features is not None:
                missing = [f for f in features if f not in dict(layout)]
                if missing:
                    raise NbestFormatError(f"features {missing} are not in the list", path, group[0].line_no)
            if data is None:
                chosen = layout if features is None else tuple(g for g in layout if g[0] in features)
                data = MertData(chosen)
            matrix = group_arrays(group, layout, path)
            if features is not None:
                matrix = matrix[:, _columns(layout, data.layout)]
            elif layout != data.layout:
                raise NbestFormatError(f"features {layout} differ from {data.layout} of the first list", path, group[0].line_no)
            if not warned_sparse and any(e.sparse for e in group):
                warned_sparse = True
                log.warning("%s: sparse features (names with '_') are ignored by tuning", path)
            sent = group[0].sent_id
            hyps = [e.hyp for e in group]
            if sent >= len(scorer):
                raise NbestFormatError(f"sentence id {sent} but only {len(scorer)} reference lines", path, group[0].line_no)
            stats = scorer.stats(sent, hyps)
            new = _new_indices(data, sent, matrix, stats)
            if new:
                added += data.add(sent, matrix[new], stats[new], [hyps[i] for i in new])
        log.info("%s: %d new hypotheses", path, added)
    if data is None or not data.feats:
        raise InputError("no hypotheses in the n-best lists: " + ", ".join(paths))
    return data


def _new_indices(data: MertData, sent: int, matrix: np.ndarray, stats: np.ndarray) -> list[int]:
    """Rows not yet known for ``sent``: duplicates have equal features and statistics (as Moses)."""
    seen: set[tuple[bytes, bytes]] = set()
    if sent in data.feats:
        seen = {(f.tobytes(), s.tobytes()) for f, s in zip(data.feats[sent], data.stats[sent])}
    new = []
    for i, (f, s) in enumerate(zip(matrix, stats)):
        key = (f.tobytes(), s.tobytes())
        if key not in seen:
            seen.add(key)
            new.append(i)
    return new


def _columns(full: Layout, chosen: Layout) -> list[int]:
    starts, pos = {}, 0
    for name, n in full:
        starts[name] = pos
        pos += n
    return [starts[name] + i for name, n in chosen for i in range(n)]


class PackedData:
    """MertData as padded arrays for vectorised line searches."""

    def __init__(self, data: MertData) -> None:
        sents = sorted(data.feats)
        self.sent_ids = sents
        kmax = max(len(data.feats[s]) for s in sents)
        n, d = len(sents), data.dim
        self.feats = np.zeros((n, kmax, d), dtype=np.float64)
        self.stats = np.zeros((n, kmax, N_STATS), dtype=np.float64)
        self.mask = np.zeros((n, kmax), dtype=bool)
        for row, s in enumerate(sents):
            k = len(data.feats[s])
            self.feats[row, :k] = data.feats[s]
            self.stats[row, :k] = data.stats[s]
            self.mask[row, :k] = True
        self.rows = np.arange(n)

    def best_indices(self, w: np.ndarray) -> np.ndarray:
        """Index of each sentence's highest-scoring hypothesis under ``w`` (first on ties)."""
        scores = np.where(self.mask, self.feats @ w, -np.inf)
        return np.asarray(scores.argmax(axis=1))

    def corpus_stats(self, w: np.ndarray) -> np.ndarray:
        return np.asarray(self.stats[self.rows, self.best_indices(w)].sum(axis=0))


@dataclass(frozen=True)
class LineSearchResult:
    """Best point of one line search: step ``gamma``, its BLEU, and the interval it lies in."""

    gamma: float
    bleu: float
    interval: tuple[float, float]


def envelope_events(a: np.ndarray, b: np.ndarray, mask: np.ndarray, stats: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thresholds of every sentence's upper envelope of the lines ``a + γ b``.

    Returns (start stats (10,) summed over sentences at γ → -∞, thresholds (E,),
    statistics differences (E, 10)): crossing threshold ``x`` upwards replaces one
    sentence's 1-best, changing the corpus statistics by the difference.
    """
    n = a.shape[0]
    rows = np.arange(n)
    # At γ → -∞ the smallest slope wins; among equal slopes the largest intercept.
    b_masked = np.where(mask, b, np.inf)
    b_min = b_masked.min(axis=1, keepdims=True)
    first = np.where(mask & (b == b_min), a, -np.inf)
    cur = first.argmax(axis=1)
    start = stats[rows, cur].sum(axis=0)
    xs: list[np.ndarray] = []
    diffs: list[np.ndarray] = []
    cur_x = np.full(n, -np.inf)
    alive = np.ones(n, dtype=bool)
    while alive.any():
        r = rows[alive]
        a_c, b_c, x_c = a[r, cur[r]], b[r, cur[r]], cur_x[r]
        db = b[r] - b_c[:, None]
        valid = mask[r] & (db > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            x = np.where(valid, (a_c[:, None] - a[r]) / np.where(valid, db, 1.0), np.inf)
        x = np.maximum(x, x_c[:, None])  # rounding can put a crossing a hair before the last
        x_min = x.min(axis=1)
        done = ~np.isfinite(x_min)
        alive[r[done]] = False
        keep = ~done
        if not keep.any():
            break
        r, x, x_min = r[keep], x[keep], x_min[keep]
        # Several lines through the same crossing: the steepest one dominates after it.
        tol = 1e-12 * np.maximum(1.0, np.abs(x_min))
        cand = x <= (x_min + tol)[:, None]
        nxt = np.where(cand, b[r], -np.inf).argmax(axis=1)
        xs.append(x_min)
        diffs.append(stats[r, nxt] - stats[r, cur[r]])
        cur[r] = nxt
        cur_x[r] = x_min
    if not xs:
        return start, np.zeros(0), np.zeros((0, stats.shape[-1]))
    return start, np.concatenate(xs), np.concatenate(diffs)


def line_search(
    packed: PackedData,
    scorer: SentenceStats,
    w: np.ndarray,
    direction: np.ndarray,
    lo: float = -math.inf,
    hi: float = math.inf,
) -> LineSearchResult:
    """The exact BLEU-optimal step along ``direction`` from ``w``, with γ in [lo, hi].

    Ties between equally good intervals go to the one containing γ = 0 (no move),
    then to the one nearest to it.
    """
    a = packed.feats @ w
    b = packed.feats @ direction
    start, xs, diffs = envelope_events(a, b, packed.mask, packed.stats)
    before = xs <= lo
    start = start + diffs[before].sum(axis=0)
    inside = (~before) & (xs < hi)
    xs, diffs = xs[inside], diffs[inside]
    order = np.argsort(xs, kind="stable")
    xs, diffs = xs[order], diffs[order]
    bounds = np.unique(xs)
    cum = np.cumsum(diffs, axis=0)
    # Statistics after the last event at each distinct threshold.
    last_of_group = np.searchsorted(xs, bounds, side="right") - 1
    interval_stats = [start] + [start + cum[i] for i in last_of_group]
    edges = [lo, *bounds.tolist(), hi]
    best: tuple[float, float] | None = None
    best_k = -1
    for k, st in enumerate(interval_stats):
        left, right = edges[k], edges[k + 1]
        if right <= left:
            continue
        score = score_from_stats(scorer.metric, st).score
        distance = 0.0 if left <= 0.0 <= right else min(abs(left), abs(right))
        if best is None or (score, -distance) > best:
            best, best_k = (score, -distance), k
    if best is None:
        raise InputError(f"empty line-search range [{lo}, {hi}]")
    left, right = edges[best_k], edges[best_k + 1]
    if math.isinf(left) and math.isinf(right):
        gamma = 0.0
    elif math.isinf(left):
        gamma = right - UNBOUNDED_STEP
    elif math.isinf(right):
        gamma = left + UNBOUNDED_STEP
    else:
        gamma = (left + right) / 2
    score = best[0]
    return LineSearchResult(gamma=float(gamma), bleu=float(score), interval=(float(left), float(right)))


@dataclass(frozen=True)
class FeatureRange:
    """Constraint of one flattened weight (Moses' ``--activate-features`` / ``--ranges``).

    Fields:
        active: tuned when True; otherwise kept at its initial value.
        lo / hi: hard bounds on the weight during the search.
        init_lo / init_hi: where random restarts draw it from (clipped to lo/hi).
    """

    active: bool = True
    lo: float = -math.inf
    hi: float = math.inf
    init_lo: float = -1.0
    init_hi: float = 1.0


@dataclass(frozen=True)
class MertConfig:
    """Optimiser settings.

    Fields:
        restarts: random restarts besides the initial point (Moses' ``-n`` minus one).
        random_directions: random directions tried after the coordinate ones, per sweep.
        seed: seed of the restarts and random directions.
        max_sweeps: bound on sweeps over all directions per start point.
        min_gain: a move must gain more than this (BLEU points) to be taken.
        normalize: L1-normalise the result, as Moses' mert does.
    """

    restarts: int = 5
    random_directions: int = 3
    seed: int = 0
    max_sweeps: int = 50
    min_gain: float = 1e-6
    normalize: bool = True


@dataclass(frozen=True)
class MertResult:
    """Best weights found, their BLEU (on the tuning lists) and search statistics."""

    weights: Weights
    bleu: float
    start_bleu: float
    line_searches: int
    runs: tuple[float, ...]


def _step_range(w: np.ndarray, d: np.ndarray, ranges: Sequence[FeatureRange]) -> tuple[float, float]:
    lo, hi = -math.inf, math.inf
    for i, r in enumerate(ranges):
        if d[i] == 0:
            continue
        a, b = (r.lo - w[i]) / d[i], (r.hi - w[i]) / d[i]
        lo, hi = max(lo, min(a, b)), min(hi, max(a, b))
    return lo, hi


def optimize_from(
    packed: PackedData,
    scorer: SentenceStats,
    start: np.ndarray,
    ranges: Sequence[FeatureRange],
    config: MertConfig,
    rng: np.random.Generator,
) -> tuple[np.ndarray, float, int]:
    """Coordinate + random-direction ascent from ``start``; returns (w, BLEU, line searches)."""
    w = start.copy()
    score = score_from_stats(scorer.metric, packed.corpus_stats(w)).score
    active = np.array([r.active for r in ranges])
    searches = 0
    for _ in range(config.max_sweeps):
        directions = [np.eye(len(w))[i] for i in np.flatnonzero(active)]
        for _ in range(config.random_directions if active.sum() > 1 else 0):
            d = np.where(active, rng.standard_normal(len(w)), 0.0)
            directions.append(d / np.linalg.norm(d))
        improved = False
        for d in directions:
            lo, hi = _step_range(w, d, ranges)
            result = line_search(packed, scorer, w, d, lo, hi)
            searches += 1
            if result.bleu > score + config.min_gain:
                w = w + result.gamma * d
                w = np.clip(w, [r.lo for r in ranges], [r.hi for r in ranges])
                score = score_from_stats(scorer.metric, packed.corpus_stats(w)).score
                improved = True
        if not improved:
            break
    return w, score, searches


def tune(
    data: MertData,
    scorer: SentenceStats,
    init: Weights,
    ranges: Sequence[FeatureRange] | None = None,
    config: MertConfig = MertConfig(),
) -> MertResult:
    """MERT from ``init`` plus ``config.restarts`` random starts; the best point wins."""
    packed, start, ranges = prepare(data, init, ranges)
    rng = np.random.default_rng(config.seed)
    start_bleu = score_from_stats(scorer.metric, packed.corpus_stats(start)).score
    best_w, best_score, total = start, -1.0, 0
    runs = []
    for run in range(config.restarts + 1):
        point = start.copy() if run == 0 else _random_point(start, ranges, rng)
        w, score, searches = optimize_from(packed, scorer, point, ranges, config, rng)
        total += searches
        runs.append(score)
        log.info("MERT run %d: BLEU %.4f after %d line searches", run, score, searches)
        if score > best_score:
            best_w, best_score = w, score
    weights = Weights.from_flat(data.layout, best_w.tolist())
    if config.normalize:
        weights = weights.normalized_l1()
    return MertResult(weights, best_score, start_bleu, total, tuple(runs))


def prepare(data: MertData, init: Weights, ranges: Sequence[FeatureRange] | None
            ) -> tuple[PackedData, np.ndarray, list[FeatureRange]]:
    """A tuner's inputs: the packed data, the flat start point, one range per weight
    (unconstrained when ``ranges`` is None)."""
    start = np.asarray(init.for_layout(data.layout).flat(), dtype=np.float64)
    chosen = list(ranges) if ranges is not None else [FeatureRange()] * len(start)
    if len(chosen) != len(start):
        raise InputError(f"{len(chosen)} feature ranges for {len(start)} features")
    return PackedData(data), start, chosen


def _random_point(start: np.ndarray, ranges: Sequence[FeatureRange], rng: np.random.Generator) -> np.ndarray:
    point = start.copy()
    for i, r in enumerate(ranges):
        if r.active:
            lo, hi = max(r.init_lo, r.lo), min(r.init_hi, r.hi)
            point[i] = rng.uniform(lo, hi) if hi > lo else lo
    return point


def parse_ranges(specs: Iterable[str], layout: Layout) -> list[FeatureRange]:
    """Ranges from ``NAME[:i]=LO..HI`` specs (``NAME`` a feature group, ``i`` one of its values).

    ``LO``/``HI`` may be empty for no bound. Features not named keep the defaults.
    """
    flat_index: dict[str, list[int]] = {}
    pos = 0
    for name, n in layout:
        flat_index[name] = list(range(pos, pos + n))
        pos += n
    ranges = [FeatureRange()] * pos
    for spec in specs:
        target, sep, bounds = spec.partition("=")
        lo_text, dots, hi_text = bounds.partition("..")
        if not sep or not dots:
            raise InputError(f"range {spec!r} is not NAME[:i]=LO..HI")
        name, _, index = target.partition(":")
        if name not in flat_index:
            raise InputError(f"range {spec!r}: no feature {name!r} in the n-best list")
        columns = flat_index[name]
        if index:
            if not index.isdigit() or int(index) >= len(columns):
                raise InputError(f"range {spec!r}: {name} has {len(columns)} values")
            columns = [columns[int(index)]]
        try:
            lo = float(lo_text) if lo_text.strip() else -math.inf
            hi = float(hi_text) if hi_text.strip() else math.inf
        except ValueError as exc:
            raise InputError(f"range {spec!r}: bounds are not numbers") from exc
        if lo > hi:
            raise InputError(f"range {spec!r}: lower bound above upper bound")
        for c in columns:
            init_lo = lo if math.isfinite(lo) else min(-1.0, hi - 1.0) if math.isfinite(hi) else -1.0
            init_hi = hi if math.isfinite(hi) else max(1.0, lo + 1.0) if math.isfinite(lo) else 1.0
            ranges[c] = FeatureRange(ranges[c].active, lo, hi, init_lo, init_hi)
    return ranges


def fix_features(ranges: list[FeatureRange], names: Iterable[str], layout: Layout) -> list[FeatureRange]:
    """Ranges with every value of the named feature groups held at its initial weight."""
    wanted = set(names)
    unknown = wanted - {name for name, _ in layout}
    if unknown:
        raise InputError(f"no features {sorted(unknown)} in the n-best list")
    out, pos = list(ranges), 0
    for name, n in layout:
        for i in range(pos, pos + n):
            if name in wanted:
                r = out[i]
                out[i] = FeatureRange(False, r.lo, r.hi, r.init_lo, r.init_hi)
        pos += n
    return out


def weights_from_totals(paths: Sequence[str], layout: Layout, *, skip_bad: bool = False) -> tuple[Weights, float]:
    """The weights the decoder used, recovered from the lists' total column by least squares.

    Totals and features are centred per sentence first, so a per-sentence constant the
    list does not show (e.g. an untuned unknown-word penalty) does not disturb the fit.
    The fit uses the sentences whose features are ``layout``; where there are none (``layout``
    is a selection of the list's features, as ``tune --features`` makes), those whose
    features include all of ``layout``'s, first such layout seen, since their totals count
    every feature; the weights of ``layout`` are then kept. Returns the weights and the
    largest absolute residual.
    """
    wanted = dict(layout)
    found: dict[Layout, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for path in paths:
        for group in iter_sentences(path, skip_bad=skip_bad):
            own = group[0].layout()
            if any(dict(own).get(k) != n for k, n in wanted.items()):
                continue
            matrix = group_arrays(group, own, path)
            totals = np.asarray([e.total for e in group])
            xs, ys = found.setdefault(own, ([], []))
            xs.append(matrix - matrix.mean(axis=0))
            ys.append(totals - totals.mean())
    if not found:
        raise InputError("no hypotheses with the expected features to fit weights to")
    full = layout if layout in found else next(iter(found))
    x, y = np.vstack(found[full][0]), np.concatenate(found[full][1])
    w, residual = _fit_totals(x, y)
    return Weights.from_flat(full, w.tolist()).for_layout(layout), residual


def _fit_totals(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares of the totals ``y`` on the features ``x``, and its largest residual. A
    weight whose largest share of any total is within that residual (the totals' printed
    digits) cannot be told from 0 and is 0, the rest fitted again without it: a column the
    decoder did not weigh, such as NLM0 added by ``rescore``, starts at 0, not at -4e-08."""
    w, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = float(np.abs(x @ w - y).max()) if len(y) else 0.0
    unseen = np.abs(w) * np.abs(x).max(axis=0, initial=0.0) <= residual
    if unseen.any() and not unseen.all():
        w = np.zeros_like(w)
        w[~unseen] = np.linalg.lstsq(x[:, ~unseen], y, rcond=None)[0]
        residual = float(np.abs(x @ w - y).max())
    return w, residual


def merge(into: MertData, other: MertData) -> int:
    """Add ``other``'s hypotheses not in ``into`` (same layout); returns how many were new."""
    if other.layout != into.layout:
        raise InputError(f"feature layouts differ: {other.layout} vs {into.layout}")
    added = 0
    for sent in sorted(other.feats):
        new = _new_indices(into, sent, other.feats[sent], other.stats[sent])
        if new:
            added += into.add(sent, other.feats[sent][new], other.stats[sent][new], [other.hyps[sent][i] for i in new])
    return added
