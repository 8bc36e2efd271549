"""`python -m ssd_core.bench`: the Spec-Bench-compatible benchmark (see tools.bench)."""
import sys

from .tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
