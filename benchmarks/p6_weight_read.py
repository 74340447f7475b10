"""SPEC P6 near the limit — batch-1 decode step vs one read of the weights at the measured bandwidth

Runs the measurement in `decode_vs_context.py` (shared with related targets); the same flags apply (--quick, --out …).
"""

import sys

from decode_vs_context import main

if __name__ == "__main__":
    main(sys.argv[1:])
