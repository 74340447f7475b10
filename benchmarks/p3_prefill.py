"""SPEC P3 prefill — chunked prefill of 8,192 tokens vs token by token, same final state

Runs the measurement in `engine_inprocess.py` (shared with related targets); the same flags apply (--quick, --out …).
"""

import sys

from engine_inprocess import main

if __name__ == "__main__":
    main([*sys.argv[1:], "--targets", "P3"])
