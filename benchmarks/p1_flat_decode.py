"""SPEC P1 flat decode — batch-1 decode step at context 32,768 vs 128 (softmax and HF GPT-2 beside it)

Runs the measurement in `decode_vs_context.py` (shared with related targets); the same flags apply (--quick, --out …).
"""

import sys

from decode_vs_context import main

if __name__ == "__main__":
    main(sys.argv[1:])
