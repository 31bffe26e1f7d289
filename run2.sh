#!/usr/bin/env bash
# temporary: this session's second device call
mkdir -p /tmp/chk && tar xJf chk_tree.tar.xz -C /tmp/chk
export CHECK_RESUME=/tmp/chk
DEADLINE=280 TUNE_ARGS="--match tree" bash scripts/gpu_session.sh "$OUT/a" "tune"
DEADLINE=90 bash scripts/gpu_session.sh "$OUT/b" "bench_tree"
DEADLINE=200 TUNE_ARGS="--match commit-h4-q8-softplus-i32,commit-h16-q8-softplus-i32,commit-h32-q8-softplus-i32,commit-h32-q8-i64,commit-h96-q2-i32" bash scripts/gpu_session.sh "$OUT/c" "tune"
