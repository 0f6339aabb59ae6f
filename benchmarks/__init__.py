"""loader-search's benchmark suite: see benchmarks/README.md. Run from the repository root as
``python -m benchmarks COMMAND``."""
