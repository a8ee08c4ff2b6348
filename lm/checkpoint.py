"""Training checkpoints, the JSONL training log and the learning-curve plot.

A checkpoint (``MODEL.ckpt``) is a ``torch.save`` of tensors and plain values only (model
and optimiser state dicts, the noise generator's state, the loop's counters, the best
model so far, the training config), written atomically, and read back with
``weights_only=True`` so that loading one never runs code.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from nlmserve.errors import InputError
from nlmserve.lm.model import NeuralLM

CKPT_VERSION = 1


def save_checkpoint(
    path: str, model: NeuralLM, opt: torch.optim.Optimizer, gen: torch.Generator,
    state: dict[str, Any], best: dict[str, torch.Tensor] | None, config: dict[str, Any], vocab_sha: str,
    extra: dict[str, Any] | None = None,
) -> None:
    """Atomically write a checkpoint (tensors and plain values only: loads with weights_only);
    ``extra``: more entries of that kind (data-parallel runs: every rank's noise generator)."""
    payload = {
        "version": CKPT_VERSION,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "generator": gen.get_state(),
        "state": state,
        "best": best,
        "config": config,
        "vocab_sha256": vocab_sha,
        "model_config": model.config.to_json(),
        **(extra or {}),
    }
    tmp = path + ".tmp"
    torch.save(payload, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file
        raise InputError(f"cannot read checkpoint: {exc}", path) from exc
    if not isinstance(payload, dict) or payload.get("version") != CKPT_VERSION:
        raise InputError("not a training checkpoint of this version", path)
    return payload


# ---------------------------------------------------------------------------- logging


class TrainingLog:
    """The JSONL training log, appended to (a resumed run continues the same file);
    ``enabled=False`` (data-parallel ranks other than 0) writes nothing."""

    def __init__(self, path: str, append: bool, enabled: bool = True) -> None:
        self.path = path
        self.f = open(path, "a" if append else "w", encoding="utf-8") if enabled else None

    def write(self, **record: Any) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record, sort_keys=True) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def write_learning_curve(log_path: str, png_path: str) -> None:
    """Validation perplexity against tokens seen, from the JSONL log (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = [], []
    with open(log_path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("valid_ppl") is not None:
                xs.append(rec["tokens"])
                ys.append(rec["valid_ppl"])
    if not xs:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("validation perplexity")
    ax.set_title("best %.2f after %s tokens" % (min(ys), f"{xs[ys.index(min(ys))]:,}"))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
