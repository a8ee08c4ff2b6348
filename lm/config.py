"""A model's shape and what its objective makes of it: the header facts of a model file,
needed without torch (``nlmserve info``, ``moses-ini``) and by the network that
:mod:`nlmserve.lm.model` builds from them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: The objectives whose models score self-normalised: log p(w|h) ≈ the unnormalised score
#: (NCE and the two weak normalisers, nlmserve.lm.objectives).
SELF_NORMALIZING = ("nce", "weaknorm", "weaknormsq")

CONTEXT_TYPES = ("diagonal", "full")
ACTIVATIONS = ("none", "tanh", "relu")
OUTPUT_TYPES = ("class", "softmax", "tree", "dsoftmax")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the network (everything needed to rebuild it from a model file).

    Fields:
        vocab_size: V, including ``<unk>``, ``<s>``, ``</s>``.
        order: n of the n-gram model; the context holds ``order - 1`` words.
        dim: D, width of the word embeddings (context and output side).
        context: ``"diagonal"`` (one D-vector per context position, log-bilinear) or
            ``"full"`` (one D×D matrix per position).
        hidden: width of an optional hidden layer after the context sum (0: none).
        activation: ``"none"``, ``"tanh"`` or ``"relu"``, applied to the context vector
            (after the hidden layer when there is one).
        output: ``"class"`` (P(c|h)·P(w|c,h)) or ``"softmax"`` (the full-softmax baseline).
        num_classes: K for the class output (0 for softmax).
        ngram_class_table: size of the hashed direct n-gram feature table for the class
            scores (0: no class features). See :func:`ngram_feature_index`.
        ngram_word_table: size of the hashed direct n-gram feature table for the word
            scores (0: no word features).
        ngram_order: longest n-gram (predicted word included) with a direct feature; 0: the
            model's order. A model with a long context (order 10) keeps its features at
            5-grams, where they generalise, instead of memorising the training text's long n-grams.
        tree_nodes: internal nodes of the output tree (``output="tree"``; the tree itself
            is stored in the model file), tree_method how it was built.
        band_sizes, band_dims: words per frequency band and their embedding widths
            (``output="dsoftmax"``; sizes sum to V, widths to the context width).
    """

    vocab_size: int
    order: int = 5
    dim: int = 128
    context: str = "diagonal"
    hidden: int = 0
    activation: str = "none"
    output: str = "class"
    num_classes: int = 0
    ngram_class_table: int = 0
    ngram_word_table: int = 0
    ngram_order: int = 0
    tree_nodes: int = 0
    tree_method: str = ""
    band_sizes: tuple[int, ...] = ()
    band_dims: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {self.vocab_size}")
        if self.order < 2:
            raise ValueError(f"order must be >= 2, got {self.order}")
        if self.dim < 1 or self.hidden < 0:
            raise ValueError(f"dim must be >= 1 and hidden >= 0, got {self.dim}, {self.hidden}")
        if self.context not in CONTEXT_TYPES:
            raise ValueError(f"context must be one of {CONTEXT_TYPES}, got {self.context!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.output not in OUTPUT_TYPES:
            raise ValueError(f"output must be one of {OUTPUT_TYPES}, got {self.output!r}")
        if self.output == "class" and not 1 <= self.num_classes <= self.vocab_size:
            raise ValueError(f"class output needs 1 <= num_classes <= vocab_size, got {self.num_classes}")
        if self.ngram_class_table < 0 or self.ngram_word_table < 0:
            raise ValueError("n-gram feature table sizes must be >= 0")
        if not 0 <= self.ngram_order <= self.order:
            raise ValueError(f"ngram_order must be between 0 (the model's order) and order = {self.order}, "
                             f"got {self.ngram_order}")
        if self.has_ngram_features and self.output != "class":
            raise ValueError("direct n-gram features need the class output")
        if self.has_ngram_features and self.vocab_size >= 1 << 24:
            raise ValueError("direct n-gram features need vocab_size < 2^24")
        if self.output == "tree" and self.tree_nodes < 1:
            raise ValueError("the tree output needs tree_nodes >= 1")
        if self.output == "dsoftmax" and (
            sum(self.band_sizes) != self.vocab_size or sum(self.band_dims) != self.out_dim
            or len(self.band_sizes) != len(self.band_dims) or min(self.band_dims, default=0) < 1
        ):
            raise ValueError(f"dsoftmax bands {self.band_sizes} x {self.band_dims} must cover V={self.vocab_size} "
                             f"words and the width {self.out_dim}")

    @property
    def feature_order(self) -> int:
        """Context suffixes with a direct feature: lengths 0 .. feature_order - 1."""
        return self.ngram_order or self.order

    @property
    def has_ngram_features(self) -> bool:
        return self.ngram_class_table > 0 or self.ngram_word_table > 0

    @property
    def out_dim(self) -> int:
        """Width of the context vector r that meets the output embeddings."""
        return self.hidden if self.hidden > 0 else self.dim

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON; the tree, band and ngram_order fields only when set, so a class
        or softmax model's header reads as before (older readers load it)."""
        d = dataclasses.asdict(self)
        for name in _LATER_FIELDS:
            if d[name] == _DEFAULTS[name]:
                del d[name]
            elif isinstance(d[name], tuple):
                d[name] = list(d[name])
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        d = {k: tuple(int(x) for x in v) if k in ("band_sizes", "band_dims") else v for k, v in d.items()}
        return cls(**d)


_LATER_FIELDS = ("tree_nodes", "tree_method", "band_sizes", "band_dims", "ngram_order")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
