#!/usr/bin/env bash
# Trains every variant of the comparison, one after another, at the same budget; logs to runs/NAME.log.
set -u
cd "$(dirname "$0")/.."
for name in "$@"; do
  linserve train --config "configs/train/$name.yaml" --threads "${THREADS:-2}" > "runs/$name.log" 2>&1
done
