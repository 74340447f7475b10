"""SPEC P7 mixed load — running streams' ITL p99 with and without an 8,192-token prompt arriving

Runs the measurement in `engine_inprocess.py` (shared with related targets); the same flags apply (--quick, --out …).
"""

import sys

from engine_inprocess import main

if __name__ == "__main__":
    main([*sys.argv[1:], "--targets", "P7"])
