"""Self-describing model files that load without executing code (no pickle).

Layout (all integers little-endian)::

    0   8 bytes   magic  b"NLMSERVE"
    8   uint32    format version
    12  uint64    header length H
    20  H bytes   header: UTF-8 JSON
        padding to a multiple of 64
        data: raw tensor bytes, each tensor at a 64-byte aligned offset from the data start

The header holds ``config`` (ModelConfig), ``vocabulary`` (the word list, id order),
``classes`` (WordClasses.to_json() or null), ``objective``, ``lowercase``, ``training``
(free-form metadata: corpus, steps, perplexity, ...), ``tensors`` (name → dtype, shape,
offset, nbytes), ``data_size``, ``provenance`` (version 3) and ``sha256``: the hex digest
of the canonical JSON of the header without ``sha256`` and ``provenance`` (sorted keys, no
spaces) followed by the data bytes. Loading checks magic, version, sizes and the digest,
and raises :class:`ModelFileError` with the file name on any mismatch. The digest is the
model's hash (``model_hash`` wherever the model is served or reported).

Version 2 (written only for the outputs added with it, ``tree`` and ``dsoftmax``, and for
direct features shorter than the model's order, so older readers refuse those files by their
version instead of failing later): the config may hold ``tree_nodes``, ``tree_method``,
``band_sizes``, ``band_dims``, ``ngram_order``, and a tree model
stores its tree as the int32 arrays ``tree_left``, ``tree_right``, ``tree_code_word``,
``tree_code_nodes``, ``tree_code_bits`` (:meth:`nlmserve.lm.trees.Tree.arrays`).

Version 3 (every file written now): the hash names the model, not the folder it was
trained in. What ``training`` records of where the run read and wrote (the texts' and
outputs' paths) and of how it was watched (progress, log and checkpoint settings,
``--resume``), none of which changes the weights, moves to the header's ``provenance``,
outside the hash (:data:`PROVENANCE`); everything else (weights, vocabulary, classes, the
config and the training settings that make the weights) stays inside. So the same training
in two folders or clones writes one hash. A reader joins ``provenance`` back into
``training``. Files of versions 1 and 2 hash the whole header as before and keep loading,
reporting the hash they store; a reader older than version 3 refuses a version 3 file by
its version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..common.errors import ModelFileError
from ..common.paths import atomic_output, file_kind, open_regular
from .config import SELF_NORMALIZING, ModelConfig
from .vocab import Vocabulary

if TYPE_CHECKING:
    from .classes import WordClasses
    from .model import NeuralLM

log = logging.getLogger(__name__)

MAGIC = b"NLMSERVE"
FORMAT_VERSION = 3
#: The first version whose hash leaves out the header's ``provenance``.
_PROVENANCE_VERSION = 3
#: The entries of the training record that are provenance, not model: each key of
#: ``training`` (a name, or a dict of names for the record's own dicts) whose values move to
#: the header's ``provenance``, outside the hash. Paths of what the run read and wrote,
#: settings that only say how the run was watched and resumed, and why the step that ran was
#: chosen (``step_ran`` itself made the weights and stays in the hash; two reasons for the
#: torch step, such as NLMSERVE_FUSED=0 and numba missing, give the same weights).
PROVENANCE: dict[str, tuple[str, ...]] = {
    "train": (),
    "valid": (),
    "step_reason": (),
    "train_config": ("train", "valid", "out", "workdir", "class_file", "progress", "learning_curve", "log_every",
                     "checkpoint_every", "checkpoint_share", "resume"),
}
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header length
_ALIGN = 64
#: Bytes read (and hashed) at a time.
READ_CHUNK_BYTES = 16 * 1024 * 1024
_DTYPES = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32, "uint32": np.uint32}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _canonical(header: dict[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _hashed(header: dict[str, Any], version: int) -> bytes:
    """The header bytes the hash of a file of ``version`` covers (``header`` without
    ``sha256``): all of it before version 3, all but ``provenance`` from version 3."""
    if version < _PROVENANCE_VERSION:
        return _canonical(header)
    return _canonical({key: value for key, value in header.items() if key != "provenance"})


def _split_provenance(training: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A training record → (the part the hash covers, its :data:`PROVENANCE` part)."""
    model: dict[str, Any] = {}
    provenance: dict[str, Any] = {}
    for key, value in training.items():
        inner = PROVENANCE.get(key)
        if inner == ():
            provenance[key] = value
        elif inner and isinstance(value, dict):
            model[key] = {k: v for k, v in value.items() if k not in inner}
            moved = {k: v for k, v in value.items() if k in inner}
            if moved:
                provenance[key] = moved
        else:
            model[key] = value
    return model, provenance


def _join_provenance(training: dict[str, Any], provenance: dict[str, Any]) -> dict[str, Any]:
    """The whole training record of a file: ``training`` with its ``provenance`` joined back."""
    joined = dict(training)
    for key, value in provenance.items():
        if isinstance(value, dict) and isinstance(joined.get(key), dict):
            joined[key] = {**joined[key], **value}
        else:
            joined[key] = value
    return joined


@dataclass
class ModelFile:
    """Everything a model file holds, decoded."""

    path: str
    format_version: int
    config: ModelConfig
    vocab: Vocabulary
    classes: "WordClasses | None"
    objective: str
    lowercase: bool
    training: dict[str, Any]
    tensors: dict[str, np.ndarray]
    sha256: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def self_normalized(self) -> bool:
        """Unnormalised scores approximate log-probabilities: NCE with fixed normalisers,
        the self-normalising objectives (weaknorm, weaknormsq), and the tree output (whose
        score is the log-probability itself)."""
        return self.objective in SELF_NORMALIZING or self.config.output == "tree"

    def build_model(self) -> NeuralLM:
        """The network with the stored weights (float32, on the CPU)."""
        import torch  # here, not above: reading a header (nlmserve info) needs no torch

        from .model import NeuralLM

        word_class = self.classes.word_class if self.classes is not None else None
        tree = None
        if self.config.output == "tree":
            from .trees import Tree

            try:
                tree = Tree.from_arrays(self.tensors, self.config.tree_method)
            except (KeyError, ValueError) as exc:
                raise ModelFileError(f"{self.path}: invalid output tree: {exc}") from exc
        model = NeuralLM(self.config, word_class, tree)
        state = model.state_dict()
        missing = set(state) - set(self.tensors)
        if missing:
            raise ModelFileError(f"{self.path}: tensors missing from the model file: {sorted(missing)}")
        for name, ref in state.items():
            arr = self.tensors[name]
            if tuple(arr.shape) != tuple(ref.shape):
                raise ModelFileError(
                    f"{self.path}: tensor {name} has shape {arr.shape}, the config needs {tuple(ref.shape)}"
                )
            state[name] = torch.from_numpy(np.array(arr, dtype=np.float32))
        model.load_state_dict(state)
        return model


def save_model(
    path: str | os.PathLike[str],
    model: NeuralLM,
    vocab: Vocabulary,
    classes: "WordClasses | None",
    *,
    objective: str,
    lowercase: bool = False,
    training: dict[str, Any] | None = None,
    unigram_counts: np.ndarray | None = None,
) -> str:
    """Write ``model`` atomically (temporary file + rename, removed when writing fails) as
    a version 3 file; returns its hash (the sha256 hex digest, provenance left out)."""
    import torch

    from .outputs.tree import TreeOutput

    if len(vocab) != model.config.vocab_size:
        raise ValueError(f"vocabulary has {len(vocab)} words, the model {model.config.vocab_size}")
    arrays: dict[str, np.ndarray] = {
        name: t.detach().to("cpu", torch.float32).contiguous().numpy() for name, t in model.state_dict().items()
    }
    if isinstance(model.output, TreeOutput):
        arrays.update(model.output.tree.arrays())
    if unigram_counts is not None:
        arrays["unigram_counts"] = np.ascontiguousarray(unigram_counts, dtype=np.int64)
    index: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, arr in arrays.items():
        index[name] = {"dtype": str(arr.dtype), "shape": list(arr.shape), "offset": offset, "nbytes": arr.nbytes}
        offset = _align(offset + arr.nbytes)
    data_size = offset
    hashed_training, provenance = _split_provenance(training or {})
    header: dict[str, Any] = {
        "format": "nlmserve-model",
        "config": model.config.to_json(),
        "vocabulary": vocab.words,
        "vocabulary_sha256": vocab.sha256(),
        "classes": classes.to_json() if classes is not None else None,
        "objective": objective,
        "lowercase": bool(lowercase),
        "training": hashed_training,
        "provenance": provenance,
        "tensors": index,
        "data_size": data_size,
    }
    version = FORMAT_VERSION
    digest = hashlib.sha256(_hashed(header, version))
    data = bytearray(data_size)
    for name, arr in arrays.items():
        start = index[name]["offset"]
        data[start : start + arr.nbytes] = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    digest.update(data)
    header["sha256"] = digest.hexdigest()
    header_bytes = _canonical(header)
    prefix = _PREFIX.pack(MAGIC, version, len(header_bytes))
    pad = _align(len(prefix) + len(header_bytes)) - len(prefix) - len(header_bytes)
    with atomic_output(path) as f:
        f.write(prefix)
        f.write(header_bytes)
        f.write(b"\0" * pad)
        f.write(data)
    log.info("wrote %s (%d bytes, sha256 %s)", path, len(prefix) + len(header_bytes) + pad + data_size, header["sha256"][:12])
    return str(header["sha256"])


def read_model_file(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> ModelFile:
    """Read and verify a model file; every problem is a :class:`ModelFileError`. The path is
    opened once (without blocking, so that a FIFO is refused rather than waited on) and read
    by :func:`read_model_descriptor`, at most ``max_bytes`` of it when given."""
    name = str(path)
    try:
        fd, _ = open_regular(path)
    except OSError as exc:
        raise ModelFileError(f"{name}: cannot read model file: {exc.strerror or exc}") from exc
    try:
        return read_model_descriptor(fd, name, max_bytes=max_bytes)
    finally:
        os.close(fd)


def read_model_descriptor(fd: int, name: str, *, max_bytes: int | None = None,
                          exact_size: bool = False) -> ModelFile:
    """Read and verify the model file open as ``fd`` (``name`` in every message), from that
    descriptor alone: its size by ``fstat``, then its prefix and header, then its data in
    chunks of :data:`READ_CHUNK_BYTES` into memory of its own, hashed on the way. Nothing
    past the data its header declares is read, so a file that grows meanwhile changes
    nothing. ModelFileError when it is not a regular file, when it has more than
    ``max_bytes`` bytes (before anything is read), with ``exact_size`` when it does not end
    where its data ends, and on every check :func:`read_model_file` makes. The data's memory
    is an anonymous mapping: a refused file's is unmapped before the error is raised, and
    an accepted file's when its last tensor is dropped. The descriptor stays open.

    Until the magic bytes have matched, no byte of the file appears in a message: a path
    that names some other file (``/proc/self/environ``, a key) is refused without showing
    what it holds."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ModelFileError(f"{name}: model file is {file_kind(info.st_mode)}, not a regular file")
        size = info.st_size
        if max_bytes is not None and size > max_bytes:
            raise ModelFileError(f"{name}: model file has {size} bytes, more than the {max_bytes} allowed")
        blob = bytearray(min(size, _PREFIX.size))
        del blob[_read_into(fd, memoryview(blob), 0):]
        if len(blob) == _PREFIX.size and blob[:8] == MAGIC:
            header_end = _PREFIX.size + _PREFIX.unpack(blob)[2]
            if header_end <= size:  # the header read in place: no copy of it beside it
                blob, prefix = bytearray(header_end), blob
                blob[: _PREFIX.size] = prefix
                del blob[_PREFIX.size + _read_into(fd, memoryview(blob)[_PREFIX.size :], _PREFIX.size):]
    except OSError as exc:
        raise ModelFileError(f"{name}: cannot read model file: {exc.strerror or exc}") from exc
    version, header, expected, data_start, data_size = _parse_header(name, blob, size, exact_size)
    digest = hashlib.sha256(_hashed(header, version))
    buffer = _read_data(fd, name, data_start, data_size, digest)
    try:
        if digest.hexdigest() != expected:
            raise ModelFileError(
                f"{name}: content hash mismatch (header says {expected[:16]}…, content is "
                f"{digest.hexdigest()[:16]}…): the file is corrupt or was modified"
            )
    except BaseException:
        buffer.close()
        raise
    data = memoryview(buffer)[:data_size].toreadonly()  # the tensors view it; the mapping lives as long as they do
    try:
        return _decode(name, header, data, expected, version)
    except ModelFileError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{name}: invalid model file contents: {exc}") from exc


def _read_into(fd: int, view: memoryview, offset: int, digest: Any = None) -> int:
    """Fill ``view`` from ``fd`` at ``offset``, :data:`READ_CHUNK_BYTES` at a time, each
    chunk added to ``digest`` when given → the bytes read (fewer only at the end of the file)."""
    done = 0
    with view:
        while done < len(view):
            with view[done : done + READ_CHUNK_BYTES] as chunk:
                got = os.preadv(fd, [chunk], offset + done)
                if got and digest is not None:
                    digest.update(chunk[:got])
            if got == 0:
                break
            done += got
    return done


def _read_data(fd: int, name: str, start: int, size: int, digest: Any) -> mmap.mmap:
    """The ``size`` data bytes of ``fd`` from ``start``, read in chunks into an anonymous
    mapping and added to ``digest`` on the way; ModelFileError (the mapping unmapped) when
    the file ends before them."""
    buffer = mmap.mmap(-1, max(size, 1))  # a mapping of no bytes cannot be made
    try:
        got = _read_into(fd, memoryview(buffer)[:size], start, digest)
        if got < size:
            raise ModelFileError(f"{name}: truncated model file (it ended after {start + got} bytes while its "
                                 f"data was read; needs {start + size})")
    except OSError as exc:
        buffer.close()
        raise ModelFileError(f"{name}: cannot read model file: {exc.strerror or exc}") from exc
    except BaseException:
        buffer.close()
        raise
    return buffer


def read_model_header(path: str | os.PathLike[str]) -> ModelFile:
    """A model file's header, decoded and checked as :func:`read_model_file` does, without
    reading its data: ``tensors`` is empty and ``sha256`` is the digest the header records
    (``read_model_file`` checks it against the content). For describing a model
    (``nlmserve info``) in the time its header takes to read. ModelFileError as
    ``read_model_file``, a file shorter than its header declares included."""
    name = str(path)
    try:
        fd, info = open_regular(path)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(info.st_mode):
                raise ModelFileError(f"{name}: model file is {file_kind(info.st_mode)}, not a regular file")
            size = info.st_size
            blob = f.read(_PREFIX.size)
            if len(blob) == _PREFIX.size and blob[:8] == MAGIC:
                blob += f.read(_PREFIX.unpack(blob)[2])
    except OSError as exc:
        raise ModelFileError(f"{name}: cannot read model file: {exc.strerror or exc}") from exc
    version, header, expected, _, _ = _parse_header(name, blob, size)
    try:
        return _decode(name, header, None, expected, version)
    except ModelFileError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{name}: invalid model file contents: {exc}") from exc


def _parse_header(name: str, blob: bytes | bytearray, size: int,
                  exact_size: bool = False) -> tuple[int, dict[str, Any], str, int, int]:
    """Check the prefix and header of a model file of ``size`` bytes whose first bytes
    (at least the prefix and the header, when the file holds them) are ``blob`` → (format
    version, header without ``sha256``, the ``sha256`` it records, data offset, data size).
    ``exact_size``: the file must end where its data ends (no bytes after it)."""
    if len(blob) < _PREFIX.size:
        if MAGIC.startswith(blob[:8]) and blob:
            raise ModelFileError(f"{name}: truncated model file ({len(blob)} bytes)")
        raise ModelFileError(f"{name}: not an nlmserve model file (too short, no magic bytes)")
    magic, version, header_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise ModelFileError(f"{name}: not an nlmserve model file (bad magic bytes)")
    header_end = _PREFIX.size + header_len
    if version > FORMAT_VERSION and (header_end > len(blob) or blob[_PREFIX.size : _PREFIX.size + 1] != b"{"):
        # A newer file still opens with magic, version, header length and a JSON header;
        # without them the bytes after the magic are something else (a pickle, say).
        raise ModelFileError(
            f"{name}: corrupt or not an nlmserve model file: the magic bytes are followed by no model "
            f"header (version field {version}, header length {header_len}, file {size} bytes)"
        )
    if version > FORMAT_VERSION:
        raise ModelFileError(
            f"{name}: model file format version {version} is newer than this nlmserve reads "
            f"(up to {FORMAT_VERSION}); upgrade nlmserve"
        )
    if version < 1:
        raise ModelFileError(f"{name}: invalid model file format version {version}")
    if header_end > len(blob):
        raise ModelFileError(f"{name}: truncated model file (header needs {header_end} bytes, file has {size})")
    try:
        header = json.loads(str(memoryview(blob)[_PREFIX.size : header_end], "utf-8"))  # no copy of the bytes
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{name}: corrupt model file header: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != "nlmserve-model":
        raise ModelFileError(f"{name}: corrupt model file header (no 'format': 'nlmserve-model')")
    try:
        expected = str(header.pop("sha256"))
        data_size = int(header["data_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{name}: corrupt model file header (missing {exc})") from exc
    data_start = _align(header_end)
    if exact_size and data_start + data_size != size:
        raise ModelFileError(f"{name}: model file has {size} bytes, its header says {data_start + data_size} "
                             f"({'truncated' if size < data_start + data_size else 'bytes after the data'})")
    if data_start + data_size > size:
        raise ModelFileError(f"{name}: truncated model file (needs {data_start + data_size} bytes, file has {size})")
    return version, header, expected, data_start, data_size


def _decode(name: str, header: dict[str, Any], data: memoryview | None, digest: str, version: int) -> ModelFile:
    """The header (and ``data``, the tensors' bytes; None: no tensors) as a ModelFile."""
    config = ModelConfig.from_json(header["config"])
    vocab = Vocabulary(header["vocabulary"])
    if len(vocab) != config.vocab_size:
        raise ModelFileError(f"{name}: vocabulary has {len(vocab)} words, config says {config.vocab_size}")
    classes = None
    if header.get("classes") is not None:
        from .classes import WordClasses

        classes = WordClasses.from_json(header["classes"])
        if len(classes.word_class) != config.vocab_size or classes.num_classes != config.num_classes:
            raise ModelFileError(f"{name}: word classes do not match the model config")
    elif config.output == "class":
        raise ModelFileError(f"{name}: a class-output model file without word classes")
    return ModelFile(
        path=name,
        format_version=version,
        config=config,
        vocab=vocab,
        classes=classes,
        objective=str(header.get("objective", "")),
        lowercase=bool(header.get("lowercase", False)),
        training=_join_provenance(dict(header.get("training") or {}), dict(header.get("provenance") or {})),
        tensors=_tensors(name, header["tensors"], data) if data is not None else {},
        sha256=digest,
    )


def _tensors(name: str, index: dict[str, Any], data: memoryview) -> dict[str, np.ndarray]:
    """The header's tensor index → arrays viewing ``data`` (no copy)."""
    tensors: dict[str, np.ndarray] = {}
    for tname, info in index.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelFileError(f"{name}: tensor {tname} has unsupported dtype {info['dtype']!r}")
        shape = tuple(int(s) for s in info["shape"])
        start, nbytes = int(info["offset"]), int(info["nbytes"])
        count = int(np.prod(shape)) if shape else 1
        if nbytes != count * np.dtype(dtype).itemsize or start < 0 or start + nbytes > len(data):
            raise ModelFileError(f"{name}: tensor {tname} lies outside the data section or has a bad size")
        arr = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=start)
        tensors[tname] = arr.reshape(shape)
    return tensors
