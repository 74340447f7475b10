"""SPEC P11 on the GPU — served 1-stream ITL p50, tokens/s at 32 and 128 streams over HTTP

Runs the measurement in `served_load.py` with `--device cuda` unless a device is named; the same flags apply
(--quick, --out …). `bash benchmarks/gpu.sh` runs it with the rest of the GPU suite.
"""

import sys

from served_load import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    main(argv if "--device" in argv or "-h" in argv or "--help" in argv else [*argv, "--device", "cuda"])
