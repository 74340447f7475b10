"""SPEC P5 serving overhead — tokens/s over HTTP/SSE vs in-engine at 1 and 32 streams

Runs the measurement in `serving_overhead.py` (shared with related targets); the same flags apply (--quick, --out …).
"""

import sys

from serving_overhead import main

if __name__ == "__main__":
    main(sys.argv[1:])
