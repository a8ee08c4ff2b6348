"""Binary trees over the vocabulary for the tree-factored output (Morin & Bengio 2005;
Mnih & Hinton 2008; Mikolov et al. 2013).

A tree has ``num_nodes`` internal nodes, each with exactly two children; every leaf is one
*code* of one word. A word may own several leaves (Mnih & Hinton's ADAPTIVE(ε) rule), then
P(w | h) is the sum over its codes. ``<s>`` owns no leaf (it is never predicted), so the
leaves' probabilities, and therefore the words', sum to one over the vocabulary.

Children are encoded as integers: ``c >= 0`` is the internal node ``c``, ``c < 0`` the leaf
of word ``-c - 1``. A code is the list of (node, bit) on the way from the root (node 0) to
its leaf, bit 1 for the left child, 0 for the right; the model gives the left child
probability σ(r·q_n + b_n) at node n.

Builders here: :func:`huffman_tree` (Huffman codes of the unigram counts, Mikolov et al.),
:func:`random_tree` (a random balanced tree, the control), and :func:`tree_from_splits`
for the recursive clusterings of :mod:`nlmserve.lm.tree_clustering`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from .vocab import BOS_ID

TREE_METHODS = ("huffman", "random", "balanced", "adaptive", "adaptive-eps")


@dataclass(frozen=True)
class TreePaths:
    """A tree's codes as three flat arrays (the scoring tables' layout, ``ScoringTables``):
    the codes of word w are code_start[w] .. code_start[w+1]-1, code c's steps on its path
    from the root are steps[step_start[c] .. step_start[c+1]-1], each step 2·node + bit (bit
    1: the code goes left at that node). ``<s>`` has no code."""

    code_start: np.ndarray  # (V+1,) int64
    step_start: np.ndarray  # (C+1,) int64
    steps: np.ndarray  # (S,) int64

    @property
    def sizes(self) -> tuple[int, int]:
        """(codes, steps)."""
        return int(self.step_start.size - 1), int(self.steps.size)


@dataclass(frozen=True)
class Tree:
    """A binary tree over words, as the model uses and the model file stores it.

    Fields:
        left, right: int32 (num_nodes,) children of each internal node (see the module doc).
        code_word: int32 (C,) the word of each code (leaf).
        code_nodes: int32 (C, L) the internal nodes on each code's path, root first,
            padded with -1 to the longest path L.
        code_bits: int8 (C, L) the branch taken at each of those nodes (1 left, 0 right,
            padding 0).
        method: how the tree was built (one of TREE_METHODS, free text otherwise).
    """

    left: np.ndarray
    right: np.ndarray
    code_word: np.ndarray
    code_nodes: np.ndarray
    code_bits: np.ndarray
    method: str = ""

    @property
    def num_nodes(self) -> int:
        return int(self.left.shape[0])

    @property
    def num_codes(self) -> int:
        return int(self.code_word.shape[0])

    @property
    def depth(self) -> int:
        return int(self.code_nodes.shape[1])

    def code_lengths(self) -> np.ndarray:
        """(C,) path length of each code."""
        lengths: np.ndarray = (self.code_nodes >= 0).sum(axis=1)
        return lengths

    def codes_of(self, word: int) -> list[str]:
        """The codes of ``word`` as bit strings ("1" left), for tests and inspection."""
        out = []
        for c in np.flatnonzero(self.code_word == word).tolist():
            n = int((self.code_nodes[c] >= 0).sum())
            out.append("".join(str(int(b)) for b in self.code_bits[c, :n]))
        return out

    def paths(self, vocab_size: int) -> "TreePaths":
        """Every word's codes as flat arrays (:class:`TreePaths`), the words in id order and
        each word's codes in their order here."""
        by_word = np.argsort(self.code_word, kind="stable")
        code_start = np.zeros(vocab_size + 1, dtype=np.int64)
        code_start[1:] = np.cumsum(np.bincount(self.code_word, minlength=vocab_size))
        lengths = self.code_lengths()[by_word]
        step_start = np.zeros(by_word.size + 1, dtype=np.int64)
        step_start[1:] = np.cumsum(lengths)
        nodes, bits = self.code_nodes[by_word], self.code_bits[by_word]
        on_path = nodes >= 0  # each row's first length entries, row after row
        steps = 2 * nodes[on_path].astype(np.int64) + bits[on_path]
        return TreePaths(code_start, step_start, steps)

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays a model file stores (names ``tree_*``)."""
        return {"tree_left": self.left, "tree_right": self.right, "tree_code_word": self.code_word,
                "tree_code_nodes": self.code_nodes, "tree_code_bits": self.code_bits.astype(np.int32)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any], method: str = "") -> "Tree":
        """Inverse of :meth:`arrays`; checks that the arrays describe a tree (ValueError)."""
        left = np.asarray(arrays["tree_left"], dtype=np.int32)
        right = np.asarray(arrays["tree_right"], dtype=np.int32)
        tree = tree_from_children(left, right, method)
        for name in ("code_word", "code_nodes", "code_bits"):
            stored = np.asarray(arrays["tree_" + name])
            if stored.shape != getattr(tree, name).shape or not np.array_equal(stored, getattr(tree, name)):
                raise ValueError(f"tree_{name} does not match the tree's children arrays")
        return tree

    def validate(self, vocab_size: int) -> None:
        """Every word but ``<s>`` owns at least one leaf, ``<s>`` none (ValueError)."""
        owned = np.bincount(self.code_word, minlength=vocab_size)
        if owned.shape[0] != vocab_size or self.code_word.min() < 0:
            raise ValueError(f"tree leaves name words outside [0, {vocab_size})")
        if owned[BOS_ID]:
            raise ValueError("<s> cannot be a leaf of the output tree")
        missing = np.flatnonzero(owned == 0)
        missing = missing[missing != BOS_ID]
        if missing.size:
            raise ValueError(f"words without a leaf in the output tree: {missing[:5].tolist()}")


def tree_from_children(left: np.ndarray, right: np.ndarray, method: str = "") -> Tree:
    """The codes of the tree whose internal node n has children ``left[n]``, ``right[n]``
    (root 0). ValueError unless every internal node is reached exactly once."""
    K = int(left.shape[0])
    if K < 1 or right.shape != left.shape:
        raise ValueError("a tree needs at least one internal node and as many left as right children")
    seen = np.zeros(K, dtype=bool)
    codes: list[tuple[int, list[int], list[int]]] = []
    stack: list[tuple[int, list[int], list[int]]] = [(0, [], [])]
    while stack:
        node, path, bits = stack.pop()
        if node >= K or seen[node]:
            raise ValueError(f"tree node {node} is out of range or reached twice")
        seen[node] = True
        for child, bit in ((int(right[node]), 0), (int(left[node]), 1)):
            if child < 0:
                codes.append((-child - 1, path + [node], bits + [bit]))
            else:
                stack.append((child, path + [node], bits + [bit]))
    if not seen.all():
        raise ValueError(f"tree nodes not reachable from the root: {np.flatnonzero(~seen)[:5].tolist()}")
    L = max(len(p) for _, p, _ in codes)
    nodes = np.full((len(codes), L), -1, dtype=np.int32)
    bitarr = np.zeros((len(codes), L), dtype=np.int8)
    words = np.empty(len(codes), dtype=np.int32)
    for i, (w, p, b) in enumerate(codes):
        words[i] = w
        nodes[i, : len(p)] = p
        bitarr[i, : len(b)] = b
    return Tree(left.astype(np.int32), right.astype(np.int32), words, nodes, bitarr, method)


def _leaf(word: int) -> int:
    return -word - 1


def tree_words(vocab_size: int) -> np.ndarray:
    """The words a tree holds: every id but ``<s>``."""
    ids = np.arange(vocab_size)
    words: np.ndarray = ids[ids != BOS_ID]
    return words


def huffman_tree(counts: np.ndarray) -> Tree:
    """Huffman tree of the unigram counts (every word but ``<s>``; counts below 1 count
    as 1). Ties go to the item made first (words by id, then merged nodes), so the tree is
    deterministic. The frequent words get the short codes."""
    counts = np.asarray(counts, dtype=np.float64)
    words = tree_words(counts.shape[0])
    heap: list[tuple[float, int, int]] = [(max(float(counts[w]), 1.0), i, _leaf(int(w))) for i, w in enumerate(words)]
    heapq.heapify(heap)
    left: list[int] = []
    right: list[int] = []
    tick = len(heap)
    while len(heap) > 1:
        c1, _, a = heapq.heappop(heap)
        c2, _, b = heapq.heappop(heap)
        left.append(a)
        right.append(b)
        heapq.heappush(heap, (c1 + c2, tick, len(left) - 1))
        tick += 1
    # Merges are numbered bottom-up; the root is the last merge: renumber so it is 0.
    K = len(left)
    remap = np.array([K - 1 - i for i in range(K)])
    fix = np.vectorize(lambda c: c if c < 0 else int(remap[c]), otypes=[np.int64])
    lo = fix(np.array(left[::-1]))
    ro = fix(np.array(right[::-1]))
    return tree_from_children(lo, ro, "huffman")


def tree_from_splits(root: Any, method: str) -> Tree:
    """A tree from nested pairs: a leaf is a word id (int), an internal node a pair
    (left, right). Built without recursion (deep trees are fine)."""
    left: list[int] = []
    right: list[int] = []
    stack: list[tuple[Any, int, int]] = [(root, -1, 0)]  # (subtree, parent node, side)
    while stack:
        sub, parent, side = stack.pop()
        if isinstance(sub, (int, np.integer)):
            ref = _leaf(int(sub))
        else:
            ref = len(left)
            left.append(0)
            right.append(0)
            stack.append((sub[1], ref, 0))
            stack.append((sub[0], ref, 1))
        if parent >= 0:
            (left if side == 1 else right)[parent] = ref
    return tree_from_children(np.array(left), np.array(right), method)


def balanced_split(items: list[int]) -> Any:
    """Nested pairs of a balanced tree over ``items`` in their order (first half left)."""
    if len(items) == 1:
        return items[0]
    # An explicit stack would do too; the depth is log2(len(items)).
    mid = (len(items) + 1) // 2
    return (balanced_split(items[:mid]), balanced_split(items[mid:]))


def random_tree(vocab_size: int, seed: int = 1) -> Tree:
    """A random balanced tree: the words (all but ``<s>``) shuffled, split in halves
    recursively (the control of Mnih & Hinton 2008)."""
    words = tree_words(vocab_size)
    order = np.random.default_rng(seed).permutation(words).tolist()
    return tree_from_splits(balanced_split(order), "random")


def node_log_odds(tree: Tree, counts: np.ndarray) -> np.ndarray:
    """(num_nodes,) log(mass left / mass right) of the add-one unigram under each node,
    a word's mass shared equally among its codes: as node biases with zero weights the
    tree gives the unigram distribution."""
    counts = np.asarray(counts, dtype=np.float64) + 1.0
    per_code = counts[tree.code_word] / np.bincount(tree.code_word, minlength=counts.shape[0])[tree.code_word]
    left = np.zeros(tree.num_nodes)
    right = np.zeros(tree.num_nodes)
    valid = tree.code_nodes >= 0
    rows, cols = np.nonzero(valid)
    nodes = tree.code_nodes[rows, cols]
    mass = per_code[rows]
    is_left = tree.code_bits[rows, cols] == 1
    np.add.at(left, nodes[is_left], mass[is_left])
    np.add.at(right, nodes[~is_left], mass[~is_left])
    return np.log(left) - np.log(right)
