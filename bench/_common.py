"""What every benchmark records beside its numbers: the machine it ran on, and the CPU time of
a process tree (a server and the helpers it started).

    from bench._common import machine, tree_cpu_seconds, write_json
    from bench._common import tree_pids, resident_bytes  # a server's processes and their memory
    from bench._common import logged_heaps         # the heap lines a server logs on SIGUSR1
    from bench._common import random_class_model   # a model file for speed benchmarks
    from bench._common import write_section        # a script's section of a document, between markers
    from bench._common import write_saved          # --render DOC JSON: that section from a saved run
    from bench._common import require_scoring_tables  # before a run that asks for scoring=local
    from bench._common import shown_command        # a recorded command line as a page prints it
    from bench._common import training_step        # the step a training ran, refused when not the one asked

Benchmarks run from the checkout as ``python -m bench.NAME``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn

from nlmserve.common.memory import resident_bytes as resident_bytes  # re-exported: the benchmarks' one

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_REPO = Path(__file__).resolve().parent.parent
#: An absolute path in a command line: after a space, ``=``, ``,`` or ``:``, up to the next of them.
_ABSOLUTE = re.compile(r"(?<![\w./-])/[^\s=,:'\"]+")
_SCRIPT = re.compile(r"^(?:\S*python3?\s+)?(bench|experiments)/(\w+)\.py\b")


def machine() -> dict[str, Any]:
    """CPU model, cores, Python and torch versions, platform, and the 1-minute load average
    when the benchmark started (the cores are shared: a busy machine moves every number)."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(), "load_average_1m": round(os.getloadavg()[0], 2)}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    return info


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _tree(root: int) -> dict[int, float]:
    """CPU seconds of ``root`` and every live descendant, by pid (``root`` first)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                stats[int(entry.name)] = st
    tree: dict[int, float] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        if pid in tree or pid not in stats:
            continue
        tree[pid] = stats[pid][1]
        frontier.extend(child for child, (parent, _) in stats.items() if parent == pid)
    return tree


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of ``root`` and every live descendant (e.g. ``nlmserve serve``
    and the native front end it started). Children that have exited are counted in their
    parent's total only once waited for, so read this before and after a run of a server that
    keeps its children alive."""
    return sum(_tree(root).values())


#: The line ``serve`` (logger nlmserve.server.app) and its native front end
#: (nlmserve.server.frontend) log on SIGUSR1 (``common.memory.heap_report``,
#: server/native/memory.h).
HEAP_LINE = re.compile(r"(?P<logger>nlmserve\.server\.\w+): (?:received|got) SIGUSR1: heap: (?P<in_use>[0-9.]+) MiB "
                       r"in use, (?P<free>[0-9.]+) MiB free, (?P<resident>[0-9.]+) MiB resident")


def logged_heaps(lines: list[str]) -> dict[str, dict[str, float]]:
    """The heap each process logged on SIGUSR1 among ``lines`` (its last), by logger:
    ``in_use``, ``free`` and ``resident``, MiB."""
    out = {}
    for line in lines:
        found = HEAP_LINE.search(line)
        if found:
            out[found["logger"]] = {key: float(found[key]) for key in ("in_use", "free", "resident")}
    return out


def signalled_heaps(process: Any, log_path: Path, processes: int, timeout: float) -> dict[str, dict[str, float]]:
    """SIGUSR1 to ``process`` (``nlmserve serve``); the heap lines its ``processes`` (the model
    server, and the native front end) then log to ``log_path``, by logger (:func:`logged_heaps`):
    those that came within ``timeout`` seconds."""
    try:
        offset = log_path.stat().st_size
    except OSError:
        offset = 0
    process.send_signal(signal.SIGUSR1)
    found: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + timeout
    while len(found) < processes and time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            with open(log_path, "rb") as f:
                f.seek(offset)
                found = logged_heaps(f.read().decode("utf-8", errors="replace").splitlines())
        except OSError:
            pass
    return found


def tree_pids(root: int) -> list[int]:
    """``root`` and its live descendants (``root`` first; empty when it is gone)."""
    return list(_tree(root))


def write_json(path: Path, result: Any) -> None:
    """``result`` as indented JSON, written beside ``path`` and renamed over it; nothing is
    left beside it when that fails (``path`` a directory, say)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def train_seconds(model_path: str | Path) -> float:
    """A training's wall time, from the end record of the log written beside its model file
    (the model file records nothing of the clock)."""
    for line in reversed(Path(f"{model_path}.log.jsonl").read_text().splitlines()):
        record = json.loads(line)
        if record.get("event") == "end":
            return float(record["elapsed"])
    raise SystemExit(f"{model_path}.log.jsonl has no end record")


#: The steps a training benchmark passes to ``nlmserve train --step``: never ``auto``, which
#: would measure whichever step the run happened to get (NLMSERVE_FUSED=0, numba missing).
TRAINING_STEPS = ("fused", "torch")


def training_step(record: Mapping[str, Any], asked: str, where: str) -> dict[str, str]:
    """``{"step": STEP, "step_reason": WHY}`` of a training, from its log's start record or its
    model file's training record (``step_ran``, ``step_reason``); SystemExit when the record
    names no step (``where`` predates the record) or another step than ``asked``: the run
    measured a step the benchmark did not mean to measure."""
    ran = record.get("step_ran")
    if ran is None:
        raise SystemExit(f"{where} does not say which training step ran (a trainer older than step_ran)")
    if ran != asked:
        raise SystemExit(f"{where}: the {ran} step ran ({record.get('step_reason')}), not the {asked} step "
                         "this benchmark measures")
    return {"step": str(ran), "step_reason": str(record.get("step_reason", ""))}


def random_class_model(texts: list[Path], vocab_size: int, order: int, dim: int, seed: int, path: Path) -> None:
    """Save a random class-factored NCE model over the ``vocab_size`` most frequent words of
    ``texts`` (.xz), with sqrt(V) frequency classes on their counts: the model of the speed
    benchmarks (its weights do not matter, its shapes do)."""
    import lzma
    from collections import Counter

    import numpy as np
    import torch

    from nlmserve.lm.classes import default_num_classes, frequency_binning
    from nlmserve.lm.config import ModelConfig
    from nlmserve.lm.model import NeuralLM
    from nlmserve.lm.model_file import save_model
    from nlmserve.lm.vocab import Vocabulary

    counts: Counter[str] = Counter()
    for text in texts:
        with lzma.open(text, "rt", encoding="utf-8") as f:
            for line in f:
                counts.update(line.split())
    vocab = Vocabulary.build(counts, max_vocab=vocab_size)
    unigram = np.array([counts.get(w, 0) for w in vocab.words], dtype=np.float64)
    classes = frequency_binning(unigram, default_num_classes(len(vocab)))
    torch.manual_seed(seed)
    net = NeuralLM(ModelConfig(vocab_size=len(vocab), order=order, dim=dim, num_classes=classes.num_classes),
                   classes.word_class)
    net.init_biases(unigram)
    save_model(path, net, vocab, classes, objective="nce", lowercase=True)


def read_doc(doc: Path) -> str:
    """The text of a document a benchmark writes into; one line (SystemExit) when it is not
    UTF-8 text (a missing file or a folder is an OSError, which :func:`exit_with` prints)."""
    try:
        return doc.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"{doc}: not a text document ({e})") from None


def write_section(doc: Path, begin: str, end: str, text: str) -> None:
    """Replace ``doc``'s section from the line ``begin`` to the line ``end`` by ``text`` (which
    holds both markers), atomically; SystemExit when the markers are not there. What follows
    ``end`` is kept as it is, so writing the same text again leaves the document unchanged."""
    old = read_doc(doc)
    if begin not in old or end not in old:
        raise SystemExit(f"{doc}: no '{begin}' ... '{end}' section to replace")
    head, rest = old.split(begin, 1)
    _, tail = rest.split(end, 1)
    tmp = doc.with_name(doc.name + ".tmp")
    tmp.write_text(head + text.rstrip("\n") + tail, encoding="utf-8")
    tmp.replace(doc)


def read_saved(saved: Path) -> Any:
    """A saved run's JSON; one line (SystemExit) when the file is not one."""
    try:
        return json.loads(saved.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"{saved}: not a saved run's JSON ({e})") from None


def write_saved(doc: Path, saved: Path, script: str, render: Callable[[Any], str]) -> None:
    """``--render DOC JSON``: ``script``'s section of ``doc`` rewritten from a saved run's JSON
    by ``render``, measuring nothing."""
    write_section(doc, *markers(script), render(read_saved(saved)))


def machine_line(m: Mapping[str, Any]) -> str:
    """A run's machine as its rendered section opens: ``AMD EPYC, 2 cores, load average 0.5
    at the start`` (``m``: :func:`machine`'s record)."""
    return f"{m['cpu']}, {m['cores']} cores, load average {m['load_average_1m']} at the start"


def markers(script: str, section: str | None = None, room: str = "bench") -> tuple[str, str]:
    """The comment lines around a benchmark's rendered section in a page: ``ROOM/SCRIPT``'s
    main one (``bench/`` unless ``room`` says ``experiments``), or a named ``section`` of its
    own, so that one page holds several runs."""
    name = f"{room}/{script}" + (f" {section}" if section else "")
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def shown_command(command: str) -> str:
    """A recorded command line as a page prints it: a path inside this checkout relative to
    it, one in a ``shared`` folder (``/work/shared/data/...``, wherever the checkout that ran it
    stood) as ``../shared/data/...``, any other absolute
    path (a scratch folder, a build elsewhere) by its file name, as the scripts' usage lines
    name them; a script of bench/ or experiments/, of this checkout or of the one that ran it,
    as the command that runs it (``python -m bench.NAME``). The JSON keeps the command as it ran."""

    def short(m: re.Match[str]) -> str:
        path = Path(m.group(0))
        if path.is_relative_to(_REPO) and path != _REPO:
            return path.relative_to(_REPO).as_posix()
        if len(path.parts) > 2 and path.parts[-2] in ("bench", "experiments") and path.suffix == ".py":
            return Path(*path.parts[-2:]).as_posix()  # a script of whichever checkout ran it
        if "shared" in path.parts[:-1]:  # wherever the checkout that ran it stood
            at = len(path.parts) - 1 - path.parts[::-1].index("shared")
            return "../" + Path(*path.parts[at:]).as_posix()
        return path.name or m.group(0)

    return _SCRIPT.sub(r"python -m \1.\2", _ABSOLUTE.sub(short, command))


def require_scoring_tables(model: str | Path, what: str) -> None:
    """SystemExit, before a long run starts, when ``model`` has no scoring tables for the
    decoder's ``scoring=local`` (``what`` names the option that asked for it); the decoder
    would fail at its load, after the runs before it."""
    from nlmserve.lm.scoring import LanguageModel

    why = LanguageModel.load(model, device="cpu").scoring_tables_missing()
    if why is not None:
        raise SystemExit(f"{what}: scoring=local needs the model's scoring tables, and {model} has none: {why}")


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Run a benchmark's ``main`` and exit with its code; a project error (a wrong model file,
    a missing input) or a file error is one line on stderr and exit code 1, as ``nlmserve``
    prints it, not a traceback."""
    from nlmserve.cli import error_line
    from nlmserve.common.errors import NlmserveError

    try:
        code = main()
    except (NlmserveError, OSError) as exc:
        raise SystemExit(error_line(exc)) from None
    raise SystemExit(code)
