"""What every room shares: the ``nlmserve`` command line's dispatcher, errors, log bases,
perplexity, progress, token files, KenLM files and query lines, serve's start-up lines."""
