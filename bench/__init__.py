"""The product's benchmarks, run from the checkout as ``python -m bench.NAME``; each script's docstring has its usage."""
