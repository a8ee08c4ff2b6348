"""What every room shares: errors, perplexity, progress, flags, paths, KenLM files and query
lines, serve's start-up lines. The rules of the wire are ``nlmserve.wire``'s; the command
line's dispatcher is ``nlmserve.cli``."""
