"""A model's scoring tables as one file every decoder on a host maps (``nlmserve export-tables``),
self-contained as KenLM's binary files are: the tables, the vocabulary and the facts a decoder
needs, so that a decoder given the file needs no server.

``scoring=local`` scores in the decoder from the tables ``GetScoringTables`` streams
(``ScoringTables``). Written here once, the file is mapped read-only by every process (the
Moses feature's ``tables=FILE``; C++ ``nlmserve::MapTablesFile`` in nlmserve_tables_file.h;
``nlmserve query --tables``, nlmserve.lm.tables_scorer): the page cache holds one copy for
the host.

Version 2 (little-endian; the Python owner of the format, the C++ one is MapTablesFile;
proto/contract/scoring_tables*.nlt are files of it). A header of one page::

    0    8 bytes  magic "NLMTABLE"
    8    u32  version (2)
    12   u32  order            16  u32 vocab_size        20  u32 dim
    24   u32  feature_order    28  u32 ngram_class_table 32  u32 ngram_word_table
    36   u32  tree_nodes       40  u32 tree_codes        44  u32 flags (bit 0: lowercase)
    48   u64  tree_steps
    56   u32  bos_id           60  u32 eos_id            64  u32 unk_id
    68   u32  quantization (0 none: float32, 1 fp16, 2 int8 with a float32 scale per row)
    72   f64  error_bound: the most a score may move from float32's, in nats (nlmserve.lm.quantize)
    80   16 bytes output ("class" or "tree"), 96 16 bytes activation (none, tanh or relu)
    112  64 bytes model_hash (the model file's)
    176  64 bytes sha256 (hex) of every byte after the header: ``nlmserve info FILE --verify``
              checks it; mapping does not (it would read the whole file)
    240  u32  vocab_buckets (a power of two)    244  u32 sections (8)
    248  u64  header_check: FNV-1a 64 of the header's 4096 bytes with these 8 as zeros,
              checked by every reader at open
    256  8 × (u64 offset, u64 bytes): the sections, in this order, each at a multiple of 64
              (position at 4096, page-aligned), all text fields NUL-padded

    position      (order-1)·V rows of dim values (float32, fp16 or int8): position j's row of
                  word w is row j·V + w
    position_scale  int8: a float32 scale per position row (else empty)
    output        V rows (class output) or tree_nodes rows (tree) of dim values
    output_scale  int8: a float32 scale per output row (else empty)
    rest          float32: bias; with features the word classes, ngram_class, ngram_word; with
                  a tree code_start, step_start, steps (GetScoringTables' array after
                  position and output; proto/nlmserve/v1/lm.proto, ScoringTablesChunk)
    words         the words' UTF-8 bytes, by id, back to back
    word_starts   u32 × (V+1): word i is words[starts[i]:starts[i+1]]
    vocab_table   vocab_buckets × (u64 key, u32 id, u32 0): a probing hash table (KenLM's
                  ProbingVocabulary): key = FNV-1a 64 of the word's bytes, its home bucket
                  the top log2(buckets) bits of key · 0x9E3779B97F4A7C15 (mod 2^64), the
                  next bucket on a collision (wrapping), id 0xFFFFFFFF in an empty one

Words are looked up as they are stored (a lowercased model's are lowercase: the reader
lowercases a word first, by ``str.lower``, when the lowercase flag is set). Version 1 (the
arrays and the hash only) is refused with the command that writes version 2.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from . import quantize as quant
from ..wire.ngrams import BOS_ID, EOS_ID, UNK_ID
from ..common.errors import ModelFileError
from ..common.paths import file_kind, open_regular
from ..common.paths import atomic_output

if TYPE_CHECKING:
    from .trees import TreePaths

log = logging.getLogger(__name__)

MAGIC = b"NLMTABLE"
VERSION = 2
HEADER_BYTES = 4096  # a page: the position rows start page-aligned in the mapping
ALIGN = 64
SECTIONS = ("position", "position_scale", "output", "output_scale", "rest", "words", "word_starts", "vocab_table")
LOWERCASE_FLAG = 1
EMPTY_BUCKET = 0xFFFFFFFF
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
BUCKET_MULTIPLIER = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1
_HEAD = struct.Struct("<8sIIIIIIIIIIQIIIId16s16s64s64sIIQ")
_SECTION = struct.Struct("<QQ")
_CHECK_AT = 248
_SECTIONS_AT = 256
_BUCKET = np.dtype([("key", "<u8"), ("id", "<u4"), ("pad", "<u4")])
_CHUNK = 1 << 22  # bytes hashed or written at a time
REWRITE = "write it again with `nlmserve export-tables --model MODEL --out {path}`"


@dataclass(frozen=True)
class FlatTables:
    """``ScoringTables`` as the wire streams them: one little-endian float32 array
    (``ScoringTables.flat``), the context width, the activation, the direct n-gram features'
    order and table sizes (0 without), the output ("class" or "tree") and a tree's nodes,
    codes and steps (0 without)."""

    data: np.ndarray
    dim: int
    activation: str
    feature_order: int = 0
    ngram_class_table: int = 0
    ngram_word_table: int = 0
    output: str = "class"
    tree_nodes: int = 0
    tree_codes: int = 0
    tree_steps: int = 0

    @classmethod
    def of(cls, tables: "StreamedTables") -> "FlatTables":
        """The wire's form of ``tables`` (UnsupportedModelError when they do not fit it)."""
        codes, steps = tables.tree.sizes if tables.tree is not None else (0, 0)
        return cls(tables.flat().astype("<f4", copy=False), tables.output.shape[1], tables.activation,
                   tables.feature_order, *tables.feature_tables, output=tables.kind,
                   tree_nodes=tables.output.shape[0] if tables.tree is not None else 0,
                   tree_codes=codes, tree_steps=steps)

    def outputs(self, vocab_size: int) -> int:
        """Rows of the output table: the tree's nodes, or one per word."""
        return self.tree_nodes or vocab_size


class StreamedTables(Protocol):
    """What :meth:`FlatTables.of` reads of ``scoring.ScoringTables`` (named here so that this
    module, which ``scoring`` reaches, imports no ``scoring``)."""

    @property
    def output(self) -> np.ndarray: ...
    @property
    def activation(self) -> str: ...
    @property
    def feature_order(self) -> int: ...
    @property
    def tree(self) -> TreePaths | None: ...
    @property
    def kind(self) -> str: ...
    @property
    def feature_tables(self) -> tuple[int, int]: ...
    def flat(self) -> np.ndarray: ...


@dataclass(frozen=True)
class TablesFileHeader:
    """What a tables file's header says (the layout in the module's docstring)."""

    version: int
    order: int
    vocab_size: int
    dim: int
    activation: str
    output: str
    feature_order: int
    ngram_class_table: int
    ngram_word_table: int
    tree_nodes: int
    tree_codes: int
    tree_steps: int
    bos_id: int
    eos_id: int
    unk_id: int
    lowercase: bool
    quantization: str
    error_bound: float
    model_hash: str
    sha256: str
    vocab_buckets: int
    sections: tuple[tuple[int, int], ...]  # (offset, bytes) of each of SECTIONS

    def section(self, name: str) -> tuple[int, int]:
        return self.sections[SECTIONS.index(name)]


# ---------------------------------------------------------------------- the vocabulary's hash
def word_key(word: bytes) -> int:
    """FNV-1a 64 of a word's bytes: its key in the vocabulary table."""
    h = FNV_OFFSET
    for b in word:
        h = ((h ^ b) * FNV_PRIME) & _U64
    return h


def home_bucket(key: int | np.ndarray, buckets: int) -> Any:
    """The bucket a key is looked for first: the top log2(buckets) bits of key · 0x9E37...15."""
    bits = buckets.bit_length() - 1
    if isinstance(key, np.ndarray):
        return (key * np.uint64(BUCKET_MULTIPLIER)) >> np.uint64(64 - bits)
    return ((key * BUCKET_MULTIPLIER) & _U64) >> (64 - bits)


def bucket_count(vocab_size: int) -> int:
    """The table's buckets: the least power of two of at least 1.5 per word (KenLM's
    probing multiplier), so that at least a third are empty and every probe ends."""
    return 1 << max(2, (vocab_size + (vocab_size + 1) // 2 - 1).bit_length())


def _word_keys(blob: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """word_key of every word at once: one pass per byte position, over the words that long."""
    lengths = np.diff(starts)
    keys = np.full(lengths.size, FNV_OFFSET, dtype=np.uint64)
    longest_first = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[longest_first]
    prime = np.uint64(FNV_PRIME)
    for k in range(int(sorted_lengths[0]) if lengths.size else 0):
        active = longest_first[:int(np.searchsorted(-sorted_lengths, -k, side="left"))]
        keys[active] = (keys[active] ^ blob[starts[active] + k].astype(np.uint64)) * prime
    return keys


def vocabulary_table(blob: np.ndarray, starts: np.ndarray, buckets: int) -> np.ndarray:
    """The probing table of the words (``blob`` bytes, ``starts`` V+1): a structured array of
    ``buckets`` (key, id, 0), built by linear probing in order of home bucket."""
    keys = _word_keys(blob, starts)
    vocab_size = keys.size
    table = np.zeros(buckets, dtype=_BUCKET)
    table["id"] = EMPTY_BUCKET
    home = home_bucket(keys, buckets).astype(np.int64)
    order = np.argsort(home, kind="stable")
    # In order of home, each word takes the first bucket at or after its home that the words
    # before it left: place_i = i + max_{k <= i} (home_k - k).
    place = np.arange(vocab_size) + np.maximum.accumulate(home[order] - np.arange(vocab_size))
    fits = place < buckets
    table["key"][place[fits]] = keys[order[fits]]
    table["id"][place[fits]] = order[fits]
    ids = table["id"]
    for word in order[~fits].tolist():  # the run went past the end: wrap to the start
        b = 0
        while ids[b] != EMPTY_BUCKET:
            b += 1
        table["key"][b] = keys[word]
        ids[b] = word
    return table


# ---------------------------------------------------------------------- writing
@dataclass(frozen=True)
class WrittenTables:
    """What ``write_tables_file`` wrote: the file's bytes and the bound it records."""

    size: int
    error_bound: float


def _aligned(at: int) -> int:
    return (at + ALIGN - 1) // ALIGN * ALIGN


def _section_sizes(order: int, vocab_size: int, dim: int, outputs: int, rest_floats: int, quantization: str,
                   words_bytes: int) -> list[int]:
    """The bytes of each of SECTIONS for tables of this shape (``outputs`` rows of output,
    ``rest_floats`` floats after them)."""
    elem = quant.ELEMENT[quantization].itemsize
    scaled = quantization == "int8"
    positions = (order - 1) * vocab_size
    return [positions * dim * elem, 4 * positions if scaled else 0, outputs * dim * elem,
            4 * outputs if scaled else 0, 4 * rest_floats, words_bytes, 4 * (vocab_size + 1),
            _BUCKET.itemsize * bucket_count(vocab_size)]


def _sizes_of(tables: FlatTables, order: int, vocab_size: int, quantization: str, words_bytes: int) -> list[int]:
    outputs = tables.outputs(vocab_size)
    rest = tables.data.size - ((order - 1) * vocab_size + outputs) * tables.dim
    return _section_sizes(order, vocab_size, tables.dim, outputs, rest, quantization, words_bytes)


def _layout(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, at = [], HEADER_BYTES
    for size in sizes:
        at = _aligned(at)
        out.append((at, size))
        at += size
    return out


def _encode_words(words: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [w.encode("utf-8") for w in words]
    starts = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=starts[1:])
    if starts[-1] >= 1 << 32:
        raise ModelFileError("the vocabulary's words take 4 GiB or more: a tables file cannot hold them")
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), starts


def tables_file_size(tables: FlatTables, words: Sequence[str], *, order: int, quantization: str = "none") -> int:
    """The bytes of the tables file of ``tables`` (for a free-space check before writing)."""
    words_bytes = sum(len(w.encode("utf-8")) for w in words)
    offset, size = _layout(_sizes_of(tables, order, len(words), quantization, words_bytes))[-1]
    return offset + size


class _Sink:
    """The file being written: bytes appended at known offsets, hashed on the way."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.at = HEADER_BYTES
        self.digest = hashlib.sha256()
        f.write(b"\0" * HEADER_BYTES)

    def pad_to(self, offset: int) -> None:
        self.write(b"\0" * (offset - self.at))

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.digest.update(data)
        self.at += len(data)

    def array(self, a: np.ndarray) -> None:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for start in range(0, flat.size, _CHUNK):
            self.write(flat[start:start + _CHUNK].tobytes())


def write_tables_file(path: str | Path, tables: FlatTables, *, order: int, words: Sequence[str], lowercase: bool,
                      model_hash: str, quantization: str = "none") -> WrittenTables:
    """Write ``tables`` of a model of ``order`` whose vocabulary is ``words`` (by id) to
    ``path`` atomically (a temporary file renamed over it, removed when writing fails), its
    position and output rows stored as ``quantization`` (nlmserve.lm.quantize); returns the
    bytes written and the error bound recorded. UnsupportedModelError when fp16 cannot hold
    the tables."""
    if quantization not in quant.QUANTIZATIONS:
        raise ValueError(f"unknown quantisation {quantization!r}; choose one of {', '.join(quant.QUANTIZATIONS)}")
    vocab_size, dim = len(words), tables.dim
    data = np.asarray(tables.data, dtype="<f4")
    outputs = tables.outputs(vocab_size)
    positions = (order - 1) * vocab_size
    position = data[:positions * dim].reshape(order - 1, vocab_size, dim)
    output = data[positions * dim:(positions + outputs) * dim].reshape(outputs, dim)
    rest = data[(positions + outputs) * dim:]
    blob, starts = _encode_words(words)
    layout = _layout(_sizes_of(tables, order, vocab_size, quantization, blob.size))
    buckets = bucket_count(vocab_size)
    table = vocabulary_table(blob, starts, buckets)
    meter = quant.ErrorMeter.empty()
    with atomic_output(path) as f:
        sink = _Sink(f)
        sink.pad_to(layout[0][0])
        scales: list[np.ndarray] = []
        for j in range(order - 1):
            meter.next_position()
            for first in range(0, vocab_size, quant.CHUNK_ROWS):
                rows = position[j, first:first + quant.CHUNK_ROWS]
                stored = quant.quantize_rows(rows, quantization)
                meter.add_position(rows, stored)
                sink.array(stored.values)
                if stored.scales is not None:
                    scales.append(stored.scales)
        sink.pad_to(layout[1][0])
        for part in scales:
            sink.array(part.astype("<f4"))
        scales = []
        sink.pad_to(layout[2][0])
        for first in range(0, outputs, quant.CHUNK_ROWS):
            rows = output[first:first + quant.CHUNK_ROWS]
            stored = quant.quantize_rows(rows, quantization)
            meter.add_output(rows, stored)
            sink.array(stored.values)
            if stored.scales is not None:
                scales.append(stored.scales)
        sink.pad_to(layout[3][0])
        for part in scales:
            sink.array(part.astype("<f4"))
        sink.pad_to(layout[4][0])
        sink.array(rest)
        sink.pad_to(layout[5][0])
        sink.array(blob)
        sink.pad_to(layout[6][0])
        sink.array(starts.astype("<u4"))
        sink.pad_to(layout[7][0])
        sink.array(table)
        assert sink.at == layout[-1][0] + layout[-1][1]
        code_steps = 0
        if tables.tree_nodes:
            step_start = rest[outputs + vocab_size + 1:outputs + vocab_size + 1 + tables.tree_codes + 1]
            code_steps = int(np.diff(step_start).max(initial=0))
        bound = meter.bound(tables.activation, dim, code_steps) if quantization != "none" else 0.0
        head = _pack_header(tables, order=order, vocab_size=vocab_size, lowercase=lowercase, model_hash=model_hash,
                            quantization=quantization, error_bound=bound, sha256=sink.digest.hexdigest(),
                            buckets=buckets, layout=layout)
        f.seek(0)
        f.write(head)
        size = sink.at
    log.info("wrote %s (%d bytes, %s, model %s)", path, size, quantization, model_hash[:12])
    return WrittenTables(size, bound)


def _pack_header(tables: FlatTables, *, order: int, vocab_size: int, lowercase: bool, model_hash: str,
                 quantization: str, error_bound: float, sha256: str, buckets: int,
                 layout: Sequence[tuple[int, int]]) -> bytes:
    head = bytearray(HEADER_BYTES)
    _HEAD.pack_into(head, 0, MAGIC, VERSION, order, vocab_size, tables.dim, tables.feature_order,
                    tables.ngram_class_table, tables.ngram_word_table, tables.tree_nodes, tables.tree_codes,
                    LOWERCASE_FLAG if lowercase else 0, tables.tree_steps, BOS_ID, EOS_ID, UNK_ID,
                    quant.code_of(quantization), error_bound, tables.output.encode("ascii"),
                    tables.activation.encode("ascii"), model_hash.encode("ascii"), sha256.encode("ascii"),
                    buckets, len(SECTIONS), 0)
    for i, (offset, size) in enumerate(layout):
        _SECTION.pack_into(head, _SECTIONS_AT + i * _SECTION.size, offset, size)
    struct.pack_into("<Q", head, _CHECK_AT, word_key(bytes(head)))
    return bytes(head)


# ---------------------------------------------------------------------- reading
def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("ascii", errors="replace")


def read_header(path: str | Path) -> tuple[TablesFileHeader, int]:
    """A tables file's header and the file's size; ModelFileError naming the file when it is
    not a tables file, of version 1 (with the command that writes version 2) or another, its
    header is damaged or does not hold together, or the file is cut short."""
    name = os.fspath(path)
    try:
        fd, info = open_regular(name)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(info.st_mode):
                raise ModelFileError(f"{name}: tables file is {file_kind(info.st_mode)}, not a regular file")
            size = info.st_size
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ModelFileError(f"{name}: {e.strerror}") from None
    if raw[:8] != MAGIC or len(raw) < 12:
        raise ModelFileError(f"{name}: not an nlmserve export-tables file (write one with `nlmserve export-tables`)")
    version = struct.unpack_from("<I", raw, 8)[0]
    if version == 1:
        raise ModelFileError(f"{name}: a tables file of version 1, which holds no vocabulary and is read no more: "
                             + REWRITE.format(path=name))
    if version != VERSION:
        raise ModelFileError(f"{name}: tables file version {version}; this nlmserve reads version {VERSION}")
    if len(raw) < HEADER_BYTES:
        raise ModelFileError(f"{name}: cut short ({size} bytes, less than its header)")
    check = struct.unpack_from("<Q", raw, _CHECK_AT)[0]
    if word_key(raw[:_CHECK_AT] + b"\0" * 8 + raw[_CHECK_AT + 8:]) != check:
        raise ModelFileError(f"{name}: its header is damaged (its check does not match): " + REWRITE.format(path=name))
    (_, _, order, vocab_size, dim, feature_order, class_table, word_table, tree_nodes, tree_codes, flags, tree_steps,
     bos_id, eos_id, unk_id, quantization, error_bound, output, activation, model_hash, sha256, buckets, count,
     _) = _HEAD.unpack_from(raw)
    sections = tuple(_SECTION.unpack_from(raw, _SECTIONS_AT + i * _SECTION.size) for i in range(len(SECTIONS)))
    head = TablesFileHeader(version, order, vocab_size, dim, _text(activation), _text(output), feature_order,
                            class_table, word_table, tree_nodes, tree_codes, tree_steps, bos_id, eos_id, unk_id,
                            bool(flags & LOWERCASE_FLAG),
                            quant.QUANTIZATIONS[quantization] if quantization < len(quant.QUANTIZATIONS) else "?",
                            error_bound, _text(model_hash), _text(sha256), buckets, sections)
    problem = _problem(head, count)
    if problem:
        raise ModelFileError(f"{name}: its header does not hold together ({problem}): " + REWRITE.format(path=name))
    end = max(offset + n for offset, n in sections)
    if size < end:
        raise ModelFileError(f"{name}: cut short ({size} bytes; its header says {end})")
    return head, size


def _problem(head: TablesFileHeader, count: int) -> str | None:
    """What in a header (its check passed) does not hold together, or None."""
    if count != len(SECTIONS):
        return f"{count} sections, not {len(SECTIONS)}"
    if head.quantization == "?":
        return "an unknown quantisation"
    if head.output not in ("class", "tree") or (head.output == "tree") != (head.tree_nodes > 0):
        return f"output {head.output!r}"
    if head.order < 2 or head.vocab_size < 3 or head.dim < 1:
        return "order, vocabulary or width"
    if head.vocab_buckets != bucket_count(head.vocab_size):
        return "the vocabulary table's size"
    outputs = head.tree_nodes or head.vocab_size
    rest = outputs + (head.vocab_size + head.ngram_class_table + head.ngram_word_table if head.feature_order else 0) \
        + (head.vocab_size + 1 + head.tree_codes + 1 + head.tree_steps if head.tree_nodes else 0)
    want = _section_sizes(head.order, head.vocab_size, head.dim, outputs, rest, head.quantization,
                          head.section("words")[1])
    at = HEADER_BYTES
    for name, (offset, size), expected in zip(SECTIONS, head.sections, want):
        if size != expected:
            return f"the {name} section holds {size} bytes, not {expected}"
        if offset % ALIGN or offset < at:
            return f"the {name} section's offset {offset}"
        at = offset + size
    return None


class TablesFile:
    """A tables file mapped read-only: its header, its arrays as numpy views of the mapping
    (``position`` (order-1, V, D), ``output`` (K, D) of the stored element type, their int8
    scales or None, ``rest`` float32) and its vocabulary."""

    def __init__(self, path: str | Path, head: TablesFileHeader, size: int) -> None:
        self.path = os.fspath(path)
        self.header = head
        self.file_bytes = size
        # A plain array over the mapping (it keeps the memmap alive): indexing a memmap makes
        # a memmap of every result, which costs more than a small gather.
        self._mapping = np.memmap(self.path, dtype=np.uint8, mode="r", shape=(size,)).view(np.ndarray)
        elem = quant.ELEMENT[head.quantization]
        V, D, n1 = head.vocab_size, head.dim, head.order - 1
        outputs = head.tree_nodes or V
        self.position = self._view("position", elem).reshape(n1, V, D)
        self.output = self._view("output", elem).reshape(outputs, D)
        scaled = head.quantization == "int8"
        self.position_scale = self._view("position_scale", np.dtype("<f4")).reshape(n1, V) if scaled else None
        self.output_scale = self._view("output_scale", np.dtype("<f4")) if scaled else None
        self.rest = self._view("rest", np.dtype("<f4"))
        self.word_starts = self._view("word_starts", np.dtype("<u4"))
        self.vocab_table = self._view("vocab_table", _BUCKET)
        self._index: dict[str, int] | None = None

    def _view(self, name: str, dtype: np.dtype[Any]) -> np.ndarray:
        offset, size = self.header.section(name)
        return self._mapping[offset:offset + size].view(dtype)

    # The header's facts most callers want.
    @property
    def order(self) -> int:
        return self.header.order

    @property
    def vocab_size(self) -> int:
        return self.header.vocab_size

    @property
    def model_hash(self) -> str:
        return self.header.model_hash

    @property
    def lowercase(self) -> bool:
        return self.header.lowercase

    def word_bytes(self, i: int) -> bytes:
        offset, size = self.header.section("words")
        a, b = int(self.word_starts[i]), int(self.word_starts[i + 1])
        if not a <= b <= size:
            raise ModelFileError(f"{self.path}: its vocabulary is damaged (word {i}): " + REWRITE.format(path=self.path))
        return bytes(self._mapping[offset + a:offset + b])

    @property
    def words(self) -> list[str]:
        """The vocabulary by id (ModelFileError when its bytes are damaged)."""
        offset, size = self.header.section("words")
        blob = bytes(self._mapping[offset:offset + size])
        starts = self.word_starts.tolist()
        if any(a > b for a, b in zip(starts, starts[1:])) or starts[-1] > size:
            raise ModelFileError(f"{self.path}: its vocabulary is damaged: " + REWRITE.format(path=self.path))
        try:
            return [blob[a:b].decode("utf-8") for a, b in zip(starts, starts[1:])]
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.path}: its vocabulary is damaged (a word is not UTF-8): "
                                 + REWRITE.format(path=self.path)) from None

    @property
    def index(self) -> dict[str, int]:
        """word → id of the whole vocabulary, built once (the probing table is C++'s way;
        in Python a dict is faster to build than the table is to probe word by word)."""
        if self._index is None:
            self._index = {w: i for i, w in enumerate(self.words)}
        return self._index

    def lookup(self, word: str) -> int | None:
        """The id of ``word`` through the file's probing table (as the C++ reader finds it;
        lowercased first when the model lowercases), or None when it is not a word of it."""
        data = (word.lower() if self.lowercase else word).encode("utf-8")
        key = word_key(data)
        buckets = self.header.vocab_buckets
        b = int(home_bucket(key, buckets))
        for _ in range(buckets):
            entry = self.vocab_table[b]
            i = int(entry["id"])
            if i == EMPTY_BUCKET:
                return None
            if int(entry["key"]) == key and i < self.vocab_size and self.word_bytes(i) == data:
                return i
            b = (b + 1) & (buckets - 1)
        return None

    def flat(self) -> FlatTables:
        """The tables as the wire's float32 array (quantised rows read as the scorers read
        them): what ``GetScoringTables`` streams for a file of quantisation "none"."""
        h = self.header
        position = quant.dequantize(self.position.reshape(-1, h.dim),
                                    None if self.position_scale is None else self.position_scale.reshape(-1))
        output = quant.dequantize(self.output, self.output_scale)
        data = np.concatenate([position.reshape(-1), output.reshape(-1), self.rest])
        return FlatTables(data, h.dim, h.activation, h.feature_order, h.ngram_class_table, h.ngram_word_table,
                          h.output, h.tree_nodes, h.tree_codes, h.tree_steps)


def file_sha256(path: str | Path, start: int = HEADER_BYTES) -> str:
    """The sha256 of a file's bytes from ``start``, read a few MB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_tables_file(path: str | Path, verify: bool = False) -> TablesFile:
    """A tables file mapped read-only (nothing is read into memory but its header);
    ModelFileError naming the file when it is not one, of version 1 or another, damaged or
    cut short, and with ``verify`` when its bytes do not match the checksum its header records."""
    head, size = read_header(path)
    if verify and file_sha256(path) != head.sha256:
        raise ModelFileError(f"{os.fspath(path)}: its tables do not match the checksum its header records "
                             "(damaged: " + REWRITE.format(path=os.fspath(path)) + ")")
    return TablesFile(path, head, size)


def describe_tables_file(path: str | Path, verify: bool = False) -> dict[str, object]:
    """What ``nlmserve info`` prints of a tables file (``verify``: every byte checked first)."""
    t = read_tables_file(path, verify=verify)
    h = t.header
    info: dict[str, object] = {
        "path": os.fspath(path), "kind": "tables file", "version": h.version, "file_bytes": t.file_bytes,
        "model_hash": h.model_hash, "order": h.order, "vocab_size": h.vocab_size, "dim": h.dim,
        "activation": h.activation, "output": h.output, "lowercase": h.lowercase,
        "ids": f"<unk> {h.unk_id}, <s> {h.bos_id}, </s> {h.eos_id}",
        "quantization": h.quantization, "error_bound": h.error_bound,
        "feature_order": h.feature_order, "ngram_tables": f"{h.ngram_class_table} {h.ngram_word_table}",
        "tree": f"{h.tree_nodes} nodes, {h.tree_codes} codes, {h.tree_steps} steps",
        "vocab_buckets": h.vocab_buckets, "sha256": h.sha256}
    if verify:
        info["verified"] = True
    return info
