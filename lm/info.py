"""What a model file is, from its header (``nlmserve info``): no weights are read.

    info = describe(read_model_header("model.nlm"))   # a dict, as ``info --json`` prints it
    print(format_info(info))                            # KEY<TAB>VALUE lines

The keys that ``GetModelInfo`` also answers have its names (``order``, ``vocab_size``,
``num_classes``, ``output_type``, ``objective``, ``self_normalized``, ``lowercase``,
``model_hash``, ``format_version``) and its values for the same file. ``config`` and
``training`` are the header's own objects, unchanged: the model's shape, and what the
trainer recorded (texts, steps, tokens, validation perplexity, the recipe and every flag).
"""

from __future__ import annotations

import os
from typing import Any

from .model_file import ModelFile

#: The training record's entries shown in the text output, in this order.
_TRAINING_KEYS = ("tokens_seen", "steps", "epochs_completed", "valid_perplexity", "stopped", "train", "valid")


def describe(model_file: ModelFile) -> dict[str, Any]:
    """The facts of a model file as one JSON-ready dict (see the module doc)."""
    cfg = model_file.config
    training = model_file.training
    train_config = training.get("train_config") or {}
    info: dict[str, Any] = {
        "path": model_file.path,
        "file_bytes": os.path.getsize(model_file.path),
        "model_hash": model_file.sha256,
        "format_version": model_file.format_version,
        "order": cfg.order,
        "vocab_size": len(model_file.vocab),
        "num_classes": cfg.num_classes,
        "class_method": model_file.classes.method if model_file.classes is not None else None,
        "output_type": cfg.output,
        "objective": model_file.objective,
        "self_normalized": model_file.self_normalized,
        "lowercase": model_file.lowercase,
        "recipe": train_config.get("recipe"),
        "tokens_seen": training.get("tokens_seen"),
        "valid_perplexity": training.get("valid_perplexity"),
        "config": cfg.to_json(),
        "training": training,
    }
    return info


def format_info(info: dict[str, Any]) -> str:
    """``describe``'s dict as KEY<TAB>VALUE lines (no trailing newline): the file, the model,
    then the training record; ``-`` for what the file does not say."""
    cfg = info["config"]
    training = info["training"]
    features = "none"
    if cfg.get("ngram_class_table") or cfg.get("ngram_word_table"):
        features = (f"class table {cfg.get('ngram_class_table', 0)}, word table {cfg.get('ngram_word_table', 0)}, "
                    f"order {cfg.get('ngram_order') or cfg['order']}")
    classes = str(info["num_classes"]) + (f" ({info['class_method']})" if info["class_method"] else "")
    rows: list[tuple[str, Any]] = [
        ("path", info["path"]),
        ("file_bytes", info["file_bytes"]),
        ("model_hash", info["model_hash"]),
        ("format_version", info["format_version"]),
        ("order", info["order"]),
        ("vocab_size", info["vocab_size"]),
        ("num_classes", classes),
        ("output_type", info["output_type"]),
        ("dim", cfg.get("dim")),
        ("context", cfg.get("context")),
        ("hidden", cfg.get("hidden")),
        ("activation", cfg.get("activation")),
        ("ngram_features", features),
        ("objective", info["objective"]),
        ("self_normalized", _yes_no(info["self_normalized"])),
        ("lowercase", _yes_no(info["lowercase"])),
        ("recipe", info["recipe"] if info["recipe"] else ("flags as given" if info["recipe"] == "" else None)),
    ]
    rows += [(key, training.get(key)) for key in _TRAINING_KEYS]
    return "\n".join(f"{key}\t{_text(value)}" for key, value in rows)


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
