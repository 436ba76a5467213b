#!/bin/bash
# The multi-row kernels on and off in the same build, alternating processes (ABAB): eval costs of k
# tokens after 200 cached ones, and the largest |verify row - one-token row| (must be 0.0 either way).
# Run from the repo root after scripts/setup.sh; OMNIDRAFT_HOME must hold the three builtin GGUFs.
set -e
for round in 1 2; do
  for cols in 0 1; do
    GGML_OMNIDRAFT_COLS=$cols .venv/bin/python scripts/measure_llamacpp_rows.py qwen gemma qwen1.5b \
      | sed "s/^/{\"cols\": $cols, \"round\": $round, \"run\": /; s/\$/}/"
  done
done
