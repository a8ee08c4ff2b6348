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

from ..common.errors import InputError
from .model import NeuralLM

#: Version 2 names the optimiser's parameters (``optimizer_params``); version 1 listed each
#: group's parameters in the model file's order, and is still read.
CKPT_VERSION = 2
READABLE_VERSIONS = (1, 2)


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
        "optimizer_params": optimizer_param_names(model, opt),
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
    if not isinstance(payload, dict) or payload.get("version") not in READABLE_VERSIONS:
        raise InputError("not a training checkpoint of this version", path)
    return payload


def optimizer_param_names(model: NeuralLM, opt: torch.optim.Optimizer) -> list[str]:
    """The model-file name of each parameter of ``opt``, in the optimiser's index order."""
    names = {id(p): n for n, p in model.file_named_parameters()}
    return [names[id(p)] for group in opt.param_groups for p in group["params"]]


def load_optimizer_state(model: NeuralLM, opt: torch.optim.Optimizer, ck: dict[str, Any]) -> None:
    """Load the checkpoint's optimiser state into ``opt``, each parameter's state to the same
    parameter whatever order the optimiser lists them in now."""
    now = optimizer_param_names(model, opt)
    saved: list[str] | None = ck.get("optimizer_params")
    if saved is None:  # version 1: each group in the model file's order
        rank = {name: i for i, name in enumerate(ck["model"])}
        names = {id(p): n for n, p in model.file_named_parameters()}
        saved = [n for g in opt.param_groups for n in sorted((names[id(p)] for p in g["params"]), key=rank.__getitem__)]
    if sorted(saved) != sorted(now):
        raise InputError("checkpoint's optimiser holds other parameters than this model's", str(sorted(set(saved) ^ set(now))))
    index = {name: j for j, name in enumerate(now)}
    state = ck["optimizer"]
    moved = {index[saved[int(i)]]: s for i, s in state["state"].items()}
    start, groups = 0, []
    for saved_group, group in zip(state["param_groups"], opt.param_groups):
        n = len(group["params"])
        groups.append({**saved_group, "params": list(range(start, start + n))})
        start += n
    opt.load_state_dict({"state": moved, "param_groups": groups})


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
