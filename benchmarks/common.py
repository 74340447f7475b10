"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | None) -> None:
    """Print the result as JSON and, if asked, write it to `out`."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]
