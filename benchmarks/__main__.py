"""``python -m benchmarks``: see benchmarks/README.md."""

from benchmarks.cli import main

main()
