"""nlmserve: a neural language-model feature server for phrase-based SMT."""

__version__ = "0.1.0"
