"""``nlmserve moses-ini``: the ``NeuralLMServer`` line that fits a model, and its starting weight.

The feature (moses_plugin/cpp/NeuralLMServer.cpp) refuses at load an ``order=`` other than
the served model's, ``scoring=local`` for a model without scoring tables, and
``scoring=local`` with ``normalized=true`` for a class-output model (whose tables give the
self-normalised score only). So the line is derived from the model, never typed:

- a model with scoring tables and a tree output: ``scoring=local normalized=true``, exact
  log-probabilities computed in the decoder;
- a model with scoring tables and a class output (self-normalised: NCE, the default):
  ``scoring=local normalized=false``, the self-normalised score computed in the decoder;
- a self-normalised model without tables (a hidden layer, a full context, a softmax
  output): ``scoring=server normalized=false``, the same score asked of the server;
- any other model (e.g. a class output trained with ``--objective mle``): ``scoring=server
  normalized=true``, exact log-probabilities from the server.

Whether a model has tables is the rule of ``nlmserve.lm.scoring.LanguageModel.
scoring_tables_missing`` (a model file, read here) or the server's own answer to
``GetScoringTables`` (asked for its first chunk only).

Given a tables file (``--tables``, of ``nlmserve export-tables``), the line is the server-free
one: ``tables=FILE`` and no ``path=``, as KENLM's line names its file. The feature then takes
the vocabulary, the model's facts and the tables from the file and needs no server; the facts of
the line come from the file's header. ``path=`` goes beside it only when a server is named
(``--server``, ``--path``): the feature then checks at load that the server serves the file's
model.

The starting weight is a fixed share, :data:`START_SHARE`, of the L1 norm of the other
weights: mert-moses.pl writes tuned weights with an L1 norm of 1 (a tuned LM0 is a few
hundredths to a tenth of it), and MERT ranks hypotheses by weight ratios only, so a share
needs no knowledge of any one weight.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.errors import InputError, NlmserveError

log = logging.getLogger(__name__)

#: NLM0's starting weight as a share of the L1 norm of the system's other (tuneable) weights.
#: Every in-decoder MERT run of experiments/moses-decoder.md started NLM0 at 0.1 beside weights of
#: L1 norm 1 and kept it positive; batch MIRA there needed half of it.
START_SHARE = 0.1

#: Where ``nlmserve serve`` listens by default: the ``path=`` of a line made from a model file.
DEFAULT_PATH = "127.0.0.1:50051"

#: Moses features that are not tuned unless their line says otherwise (mert-moses.pl leaves
#: them out of the norm it normalises).
UNTUNED_BY_DEFAULT = ("UnknownWordPenalty",)


@dataclass(frozen=True)
class ModelFacts:
    """What the feature line depends on.

    Fields:
        order: the model's n-gram order (the feature's ``order=``).
        output: the output layer (``class``, ``tree``, ``softmax``, ``dsoftmax``).
        objective: the training objective (``nce``, ``mle``, ...).
        self_normalized: unnormalised scores approximate log-probabilities.
        tables_missing: why the model has no scoring tables (None: it has them).
        model_hash: the model file's hash.
    """

    order: int
    output: str
    objective: str
    self_normalized: bool
    tables_missing: str | None
    model_hash: str


@dataclass(frozen=True)
class Scoring:
    """The feature's ``scoring=`` and ``normalized=`` for a model, and why."""

    scoring: str
    normalized: bool
    reason: str


def scoring_for(facts: ModelFacts) -> Scoring:
    """The scoring mode that fits the model (module docstring)."""
    if facts.tables_missing is None:
        if facts.output == "tree":
            return Scoring("local", True, "a tree output: exact log-probabilities computed in the decoder")
        return Scoring("local", False, "self-normalised scores computed in the decoder from the model's tables")
    if facts.self_normalized:
        return Scoring("server", False, f"no scoring tables ({facts.tables_missing}): the self-normalised "
                                        "score asked of the server")
    return Scoring("server", True, f"no scoring tables ({facts.tables_missing}): exact log-probabilities "
                                   "asked of the server")


def line_of(options: dict[str, str]) -> str:
    """The ``NeuralLMServer`` line of moses.ini's ``[feature]`` section with ``options`` in the order
    given: the one writer of the line (:func:`feature_line` and bench/decoder.py write through it).
    The feature reads it as proto/contract/moses_ini_lines.tsv states (C++
    ``nlmserve::ParseFeatureLine``; tests/test_moses_ini_lines.py checks that what this writes is
    accepted and read back as written). ValueError for an option that cannot be written as one
    word ``KEY=VALUE`` (an empty key or value, white space, ``=`` in the key)."""
    for key, value in options.items():
        if not key or not value or "=" in key or any(c.isspace() for c in key + value):
            raise ValueError(f"not a moses.ini option: {key}={value!r}")
    return "NeuralLMServer " + " ".join(f"{key}={value}" for key, value in options.items())


def feature_line(facts: ModelFacts, path: str | None, name: str = "NLM0", extra: dict[str, str] | None = None) -> str:
    """The ``NeuralLMServer`` line of moses.ini's ``[feature]`` section: ``path`` is where the model
    is served. With ``path`` None and ``tables=FILE`` among ``extra``, the server-free line: the
    feature maps the file and takes the vocabulary and the model's facts from it (``tables=``
    implies ``scoring=local``, so the line leaves ``scoring=`` out)."""
    mode = scoring_for(facts)
    if path is None and "tables" not in (extra or {}):
        raise ValueError("a feature line needs path= (a server) or tables= (a tables file)")
    if "tables" in (extra or {}) and mode.scoring != "local":
        raise ValueError(f"a model without scoring tables has no tables file: {mode.reason}")
    options = {"name": name, "factor": "0", "order": str(facts.order)}
    if path is not None:
        options["path"] = path
    options["normalized"] = "true" if mode.normalized else "false"
    if path is not None:
        options["scoring"] = mode.scoring
    return line_of({**options, **(extra or {})})


def start_weight(l1_norm: float = 1.0) -> float:
    """NLM0's starting weight beside weights of L1 norm ``l1_norm``."""
    return START_SHARE * l1_norm


def tuneable_l1_norm(text: str, path: str = "<string>") -> float:
    """The L1 norm of a moses.ini's tuneable weights: every ``[weight]`` line except those of
    features whose ``[feature]`` line says ``tuneable=false`` and of ``UnknownWordPenalty``
    (untuned unless its line says ``tuneable=true``; a ``[weight]`` section alone is read by
    these names)."""
    from .weights import parse_moses_ini

    tuneable: dict[str, bool] = {}
    section = ""
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].strip()
        if stripped.startswith("["):
            section = stripped
        elif section == "[feature]" and stripped:
            kind, *options = stripped.split()
            settings = dict(o.split("=", 1) for o in options if "=" in o)
            name = settings.get("name", kind + "0")
            default = not kind.startswith(UNTUNED_BY_DEFAULT)
            tuneable[name] = settings.get("tuneable", str(default).lower()) != "false"
    weights = parse_moses_ini(text, path)
    norm = sum(abs(v) for group, values in weights.groups if tuneable.get(group, not group.startswith(UNTUNED_BY_DEFAULT))
               for v in values)
    if norm == 0:
        raise InputError("no tuneable weight is non-zero", path)
    return norm


def facts_of_file(path: str) -> ModelFacts:
    """The facts of a model file (read and verified: ModelFileError names the file)."""
    from ..lm.scoring import LanguageModel

    lm = LanguageModel.load(path, device="cpu", cpu_tables=False)
    return ModelFacts(order=lm.order, output=lm.output_type, objective=lm.objective,
                      self_normalized=lm.self_normalized, tables_missing=lm.scoring_tables_missing(),
                      model_hash=lm.model_hash)


def facts_of_tables(path: str) -> ModelFacts:
    """The facts of the model whose tables file ``path`` is (``nlmserve export-tables``: its
    header holds the order, the output, the hash; ModelFileError names a file that is not one,
    or one of version 1). A model has a tables file only when it has scoring tables, that is
    when its scores are self-normalised (a class output) or exact (a tree); the file does not
    record the training objective."""
    from ..lm.tables_file import read_tables_file

    head = read_tables_file(path).header
    return ModelFacts(order=head.order, output=head.output, objective="", self_normalized=True,
                      tables_missing=None, model_hash=head.model_hash)


def facts_of_server(target: str, timeout: float = 30.0, client_kwargs: dict[str, Any] | None = None) -> ModelFacts:
    """The facts of the model a server serves: its ModelInfo, and whether it answers
    ``GetScoringTables`` (its first chunk, of one float, is read and the rest cancelled)."""
    import grpc

    from ..client.base import Rpc
    from ..client.core import map_error
    from ..client.sync import LMClient
    from ..proto import lm_pb2

    class TablesProbe(LMClient):
        """The client, with its TLS and token, asked for the tables' first chunk only."""

        def tables_missing(self, model_hash: str) -> str | None:
            stream = self._method(Rpc("GetScoringTables", [], stream=True))(
                lm_pb2.GetScoringTablesRequest(chunk_floats=1), timeout=self.timeout, metadata=self._metadata)
            try:
                first = next(stream)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise map_error(e, tls=self.security.uses_tls) from e
                return (e.details() or "").removeprefix("no scoring tables: ")
            finally:
                stream.cancel()
            if first.model_hash != model_hash:
                raise NlmserveError(f"the server at {self.target} changed its model while asked "
                                    f"({model_hash[:12]}, then {first.model_hash[:12]}): ask again")
            return None

    try:
        client = TablesProbe(target, timeout=timeout, **(client_kwargs or {}))
    except ValueError as e:
        raise InputError(f"--server {target}: {e}") from e
    with client:
        info = client.info
        missing = client.tables_missing(info.model_hash)
    return ModelFacts(order=info.order, output=info.output_type, objective=info.objective,
                      self_normalized=info.self_normalized, tables_missing=missing, model_hash=info.model_hash)


def render(facts: ModelFacts, path: str | None, weight: float, weight_reason: str, name: str = "NLM0",
           extra: dict[str, str] | None = None) -> str:
    """The two sections to add to moses.ini, with the reasons as comments."""
    mode = scoring_for(facts)
    objective = f", {facts.objective}" if facts.objective else ""
    where = ""
    if "tables" in (extra or {}):
        where = ("; no server: the decoder maps the tables file" if path is None
                 else f"; the server at {path} must serve the tables file's model (checked at load)")
    return (f"# model {facts.model_hash[:12]}: order {facts.order}, {facts.output} output{objective}; "
            f"{mode.reason}{where}\n"
            "[feature]\n"
            f"{feature_line(facts, path, name, extra)}\n"
            "\n"
            f"# {weight_reason}\n"
            "[weight]\n"
            f"{name}= {weight:.6g}\n")


def weight_line(feature: str, weight: float) -> str:
    """The ``[weight]`` line of the feature: ``weight`` for its score, and 0 for the count of
    words outside the model's vocabulary when the line asks for ``oov-feature`` (Moses then
    expects two weights). True as Moses' ``Scan<bool>`` reads it: yes, y, true or 1, any case."""
    oov = re.search(r"(?:^|\s)oov-feature=(\S+)", feature)
    return f"NLM0= {weight}" + (" 0" if oov and oov.group(1).lower() in ("1", "true", "yes", "y") else "")


def rewrite_ini(ini: Path, kenlm: str | None, out: Path, feature: str | None, weight: float) -> None:
    """The ini with absolute table paths, LM_PATH replaced, and the feature line and its
    weights (:func:`weight_line`) added when ``feature`` is given."""
    base = ini.resolve().parent
    lines: list[str] = []
    section = ""
    for raw in ini.read_text().splitlines():
        line = raw
        if kenlm is not None:
            line = line.replace("LM_PATH", str(Path(kenlm).resolve()))

        def absolute(m: re.Match[str]) -> str:
            value = m.group(2)
            return m.group(1) + (value if os.path.isabs(value) else str(base / value))

        if not line.lstrip().startswith("#"):
            line = re.sub(r"(\bpath=)(\S+)", absolute, line)
        if line.startswith("["):
            if section == "[weight]" and feature is not None:
                lines.append(weight_line(feature, weight))
            section = line.strip()
        lines.append(line)
        if section == "[feature]" and line.startswith("KENLM") and feature is not None:
            lines.append(feature)
    if section == "[weight]" and feature is not None:
        lines.append(weight_line(feature, weight))
    if feature is not None and not any(x == feature for x in lines):
        raise InputError("no KENLM line in its [feature] section to add the feature after", str(ini))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)


def with_server(text: str, target: str) -> str:
    """A moses.ini's text with the NeuralLMServer lines' ``path=`` set to ``target`` (a tuned
    ini names the server of its tuning, whose port a later server does not have)."""
    return re.sub(r"(NeuralLMServer [^\n]*path=)\S+", rf"\g<1>{target}", text)
