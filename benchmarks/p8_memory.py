"""SPEC P8 memory — state bytes vs formula; RSS growth over a 65,536-token generation

Runs the measurement in `memory.py` (shared with related targets); the same flags apply (--quick, --out …).
"""

import sys

from memory import main

if __name__ == "__main__":
    main(sys.argv[1:])
