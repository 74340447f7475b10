"""SPEC P2 flat when served — 8 streams x 8,192 tokens over HTTP, ITL p50 7k-8k vs 0-1k

Runs the measurement in `served_flatness.py` (shared with related targets); the same flags apply (--quick, --out …).
"""

import sys

from served_flatness import main

if __name__ == "__main__":
    main(sys.argv[1:])
