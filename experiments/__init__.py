"""Research harnesses, run from the checkout as ``python -m experiments.NAME`` (experiments/README.md)."""
