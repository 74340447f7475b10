from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"  # the scripts these tests run and import
