"""SPEC P4 batching — engine tokens/s at 32 sessions vs 1

Runs the measurement in `engine_inprocess.py` (shared with related targets); the same flags apply (--quick, --out …).
"""

import sys

from engine_inprocess import main

if __name__ == "__main__":
    main([*sys.argv[1:], "--targets", "P4"])
