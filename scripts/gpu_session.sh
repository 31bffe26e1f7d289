#!/usr/bin/env bash
# One device call on the GPU host (no package index): set up from the devkit, compile the
# shipped spaces for the host's arch, check every variant, run the GPU tests, benchmark.
# Usage (repo root, devkit copied to .devkit/): bash scripts/gpu_session.sh [OUTDIR]
# Every step logs to OUTDIR; a short summary is printed last.
set -u
out="${1:-${OUT:-/tmp/kdagen-out}}"
mkdir -p "$out"
source .devkit/install.sh /tmp/kdagen-site >/dev/null || exit 1  # (sourcing would pass our $1 as its target)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KDAGEN_CACHE="${KDAGEN_CACHE:-/tmp/kdagen-cache}"
kdagen() { python3 -m kdagen.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
step() { local name=$1; shift; local t0=$SECONDS; "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.txt"; tail -n "${TAIL:-3}" "$out/$name.log"; }
step compile kdagen compile --arch sm_90a --jobs 16
step check kdagen check --json "$out/check.json"
TAIL=8 step pytest_gpu python3 -m pytest -m gpu -q -p no:cacheprovider tests
TAIL=10 step bench_h12_q8 kdagen bench --heads 12 --window 8 --batches 1,4,16,64,256,512 --out "$out/bench_h12_q8.json"
TAIL=6 step bench_h32_q4 kdagen bench --heads 32 --window 4 --batches 1,16,96,256,512 --out "$out/bench_h32_q4.json"
TAIL=6 step bench_h96_q8 kdagen bench --heads 96 --window 8 --batches 1,32,64,256 --out "$out/bench_h96_q8.json"
echo "== summary"; cat "$out/summary.txt"
