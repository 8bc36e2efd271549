"""`python -m ssd_core.scaling`: decode speed against prompt length (see tools.scaling)."""
import sys

from .tools.scaling import main

if __name__ == "__main__":
    sys.exit(main())
