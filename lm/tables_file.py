"""A model's scoring tables as a file every decoder on a host maps once (``nlmserve export-tables``).

``scoring=local`` scores in the decoder from the tables ``GetScoringTables`` streams
(``ScoringTables``); fetched, each decoder process holds a copy of its own. Written here
once, the same array is mapped read-only by every process (``tables=FILE`` of the Moses
feature; C++ ``nlmserve::MapTablesFile`` in nlmserve_tables.h), as KenLM's binary files are:
the page cache holds one copy for the host.

Layout (little-endian; the Python owner of the format, the C++ one is MapTablesFile;
proto/contract/scoring_tables.nlt is a file of it)::

    0   8 bytes  magic "NLMTABLE"
    8   u32      version (1)
    12  u32      order            16  u32  vocab_size        20  u32  dim
    24  u32      feature_order    28  u32  ngram_class_table 32  u32  ngram_word_table
    36  u32      tree_nodes       40  u32  tree_codes        44  u32  0
    48  u64      tree_steps       56  u64  total_floats
    64  16 bytes activation (none, tanh or relu; NUL-padded)
    80  64 bytes model_hash (the model file's, NUL-padded)
    144 64 bytes sha256 of the array (hex): ``nlmserve info FILE --verify`` checks it; mapping
                 does not (it would read the whole file)
    then zeros to byte 4096, where total_floats float32 follow: GetScoringTables' array
    (proto/nlmserve/v1/lm.proto, ScoringTablesChunk)
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..common.errors import ModelFileError
from ..common.paths import atomic_output

if TYPE_CHECKING:
    from .scoring import ScoringTables

log = logging.getLogger(__name__)

MAGIC = b"NLMTABLE"
VERSION = 1
DATA_OFFSET = 4096  # a page: the array starts page-aligned in the mapping
_HEADER = struct.Struct("<8sIIIIIIIIIIQQ16s64s64s")


@dataclass(frozen=True)
class FlatTables:
    """``ScoringTables`` as the wire streams them and the tables file holds them: one
    little-endian float32 array (``ScoringTables.flat``), the context width, the activation,
    the direct n-gram features' order and table sizes (0 without), the output ("class" or
    "tree") and a tree's nodes, codes and steps (0 without)."""

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
    def of(cls, tables: ScoringTables) -> "FlatTables":
        """The wire's form of ``tables`` (UnsupportedModelError when they do not fit it)."""
        codes, steps = tables.tree.sizes if tables.tree is not None else (0, 0)
        return cls(tables.flat().astype("<f4", copy=False), tables.output.shape[1], tables.activation,
                   tables.feature_order, *tables.feature_tables, output=tables.kind,
                   tree_nodes=tables.output.shape[0] if tables.tree is not None else 0,
                   tree_codes=codes, tree_steps=steps)


@dataclass(frozen=True)
class TablesFileHeader:
    """What a tables file says of its tables (the layout in the module's docstring)."""

    order: int
    vocab_size: int
    model_hash: str
    sha256: str  # of the array, as the header records it
    tables: FlatTables


def tables_file_size(tables: FlatTables) -> int:
    """The bytes of the tables file of ``tables`` (for a free-space check before writing)."""
    return DATA_OFFSET + 4 * int(tables.data.size)


def write_tables_file(path: str | Path, tables: FlatTables, *, order: int, vocab_size: int,
                      model_hash: str) -> int:
    """Write ``tables`` of a model of ``order`` and ``vocab_size`` words to ``path``
    atomically (a temporary file renamed over it, removed when writing fails); returns the
    bytes written."""
    data = np.ascontiguousarray(tables.data, dtype="<f4")
    head = _HEADER.pack(MAGIC, VERSION, order, vocab_size, tables.dim, tables.feature_order,
                        tables.ngram_class_table, tables.ngram_word_table, tables.tree_nodes, tables.tree_codes, 0,
                        tables.tree_steps, data.size, tables.activation.encode("ascii"),
                        model_hash.encode("ascii"), _sha256(data).encode("ascii"))
    with atomic_output(path) as f:
        f.write(head)
        f.write(b"\0" * (DATA_OFFSET - len(head)))
        data.tofile(f)
    size = DATA_OFFSET + data.nbytes
    log.info("wrote %s (%d bytes, model %s)", path, size, model_hash[:12])
    return size


def _sha256(data: np.ndarray, chunk: int = 1 << 22) -> str:
    """The sha256 of an array's bytes, read a few MB at a time (a mapped file stays mapped)."""
    digest = hashlib.sha256()
    for start in range(0, data.size, chunk):
        digest.update(np.ascontiguousarray(data[start:start + chunk]).tobytes())
    return digest.hexdigest()


def read_tables_file(path: str | Path, verify: bool = False) -> TablesFileHeader:
    """A tables file's header and its array (mapped read-only, not read into memory);
    ModelFileError naming the file when it is not one or is cut short, and with ``verify``
    when the array does not match the checksum its header records."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError as e:
        raise ModelFileError(f"{path}: {e.strerror}") from None
    if len(raw) < _HEADER.size or raw[:8] != MAGIC:
        raise ModelFileError(f"{path}: not an nlmserve export-tables file (write one with `nlmserve export-tables`)")
    (_, version, order, vocab_size, dim, feature_order, class_table, word_table, tree_nodes, tree_codes, _,
     tree_steps, total, activation, model_hash, sha256) = _HEADER.unpack(raw)
    if version != VERSION:
        raise ModelFileError(f"{path}: tables file version {version}; this nlmserve reads version {VERSION}")
    if size < DATA_OFFSET + 4 * total:
        raise ModelFileError(f"{path}: cut short ({size} bytes; its header says {DATA_OFFSET + 4 * total})")
    data = np.memmap(path, dtype="<f4", mode="r", offset=DATA_OFFSET, shape=(total,))
    recorded = sha256.rstrip(b"\0").decode("ascii")
    if verify and _sha256(data) != recorded:
        raise ModelFileError(f"{path}: its tables do not match the checksum its header records (damaged: "
                             "write it again with `nlmserve export-tables`)")
    flat = FlatTables(data, dim, activation.rstrip(b"\0").decode("ascii"), feature_order, class_table, word_table,
                      "tree" if tree_nodes else "class", tree_nodes, tree_codes, tree_steps)
    return TablesFileHeader(order, vocab_size, model_hash.rstrip(b"\0").decode("ascii"), recorded, flat)


def describe_tables_file(path: str | Path, verify: bool = False) -> dict[str, object]:
    """What ``nlmserve info`` prints of a tables file (``verify``: the array checked first)."""
    head = read_tables_file(path, verify=verify)
    t = head.tables
    info: dict[str, object] = {"path": str(path), "kind": "tables file", "file_bytes": Path(path).stat().st_size,
                               "model_hash": head.model_hash, "order": head.order, "vocab_size": head.vocab_size,
                               "dim": t.dim, "activation": t.activation, "output": t.output,
                               "feature_order": t.feature_order, "ngram_tables": f"{t.ngram_class_table} {t.ngram_word_table}",
                               "tree": f"{t.tree_nodes} nodes, {t.tree_codes} codes, {t.tree_steps} steps",
                               "sha256": head.sha256}
    if verify:
        info["verified"] = True
    return info
