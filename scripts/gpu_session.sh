#!/usr/bin/env bash
# One device call on the GPU host (no package index): set up from the devkit, compile the
# shipped spaces for the host's arch, check every variant, run the GPU tests, benchmark.
# Usage (repo root, devkit copied to .devkit/): bash scripts/gpu_session.sh [OUTDIR] [STEPS]
# STEPS (default "compile check pytest bench"): any of compile, check, check_commit, pytest,
# bench, bench_commit, tune (the shipped workloads, resuming from generated/ into OUTDIR/gen,
# then serving from it; OUTDIR/gen.tgz holds the GPU's folder to copy to generated/; what the
# check steps passed before it is not checked again),
# sweep_commit (scripts/sweep_model_commit.py with SWEEP_ARGS, e.g. "--no-prefix-caching --batches 1,16"),
# profile_check (where a check's time goes: cProfile of the verify check of PROFILE_MATCH, default
# verify-h32-q8-i32-), bench_ab (scripts/bench_ab.py: kdagen bench AB_ARGS in AB_TREE, default .ab, and here, AB_ROUNDS rounds),
# sanitize (compute-sanitizer's racecheck and memcheck on a few check cases of SANITIZE_VARIANTS,
# scripts/sanitize_verify.py),
# bench_model (the all-layer commit and decode step of a 69-layer model; bench_model_softplus:
# Kimi-Linear's 20 layers at TP 1, H 32, with its softplus gate), bench_gate (the
# softplus gate's verify against its bounded twin, Kimi-Linear's shapes), check_tree and
# bench_tree (the Hopper tree verify: every variant's check; H12 Q8 tree variants beside
# their chain twins, FlashInfer's chain as the peer), check_tree_conv and bench_tree_conv (the
# conv trees' check; H12 Q8 and Q16 conv trees beside their conv chain twins), check_commit_tree (the
# tree commit's check: the conv history along the path),
# check_wide and bench_wide (windows of 9 to
# 16: every variant's check; H12 Q16 chains against FlashInfer, trees beside their chain
# twins), bench_wide_gate (Q = 16 chains with the softplus gate beside the bounded gate,
# H 32). Every step logs to
# OUTDIR (packed into OUTDIR/logs-<time>.tgz at the end); a short summary is printed last.
# Env: COMPILE_SPACES (space names, e.g. "verify_sm90.yaml commit.yaml"; default: every
# shipped space), COMPILE_MATCH (only variants whose name contains it, or one of a,b,...),
# PYTEST_FILES (default: tests),
# CHECK_SHARDS (processes, 4), CHECK_MATCH (check only variants whose name contains it, or one
# of a,b,...; CHECK_MATCH_<TAG> for one check step: VERIFY, COMMIT, COMMIT_TREE, TREE,
# TREE_CONV, WIDE),
# CHECK_RESUME (a folder of earlier check JSONs: skip what passed there at the same render),
# CHECK_TUNED (non-empty: also skip what the tuner checked in generated/'s fresh studies, e.g.
# after this call's tune step),
# DEADLINE (seconds from the start: every kdagen and pytest run is interrupted then, the tune
# keeps what it measured and a check its JSON, both resumable), BENCHES (subset of
# "h12_q8 h32_q4 h96_q8 h12_q2 h12_q8_conv"), TUNE_ARGS (extra kdagen tune options).
set -u
out="${1:-${OUT:-/tmp/kdagen-out}}"
steps="${2:-compile check pytest bench}"
mkdir -p "$out"
source .devkit/install.sh /tmp/kdagen-site >/dev/null || exit 1  # (sourcing would pass our $1 as its target)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KDAGEN_CACHE="${KDAGEN_CACHE:-/tmp/kdagen-cache}"
# The GPU tests that compare against FlashInfer and vLLM fail, not skip, without .peers.
export KDAGEN_REQUIRE_PEERS="${KDAGEN_REQUIRE_PEERS-1}"
# Within DEADLINE: SIGINT first (the tune stops cleanly), SIGKILL 20 s later.
bounded() { local left=$(( ${DEADLINE:-1000000} - SECONDS )); (( left > 5 )) || { echo "past DEADLINE: $*"; return 124; }
  timeout -s INT -k 20 "$left" "$@"; }
kdagen() { bounded python3 -m kdagen.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
step() { local name=$1; shift; local t0=$SECONDS; "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.txt"; tail -n "${TAIL:-3}" "$out/$name.log"; }
# CHECK_SHARDS (4) check processes: each spends most of its time building inputs and the fp64 reference
# on the host, so they overlap on the one GPU.
sharded_check() { local space=$1 tag=$2 n=${CHECK_SHARDS:-4} pids=() i resume=()
  local own="CHECK_MATCH_${tag^^}"; local match=${!own:-${CHECK_MATCH:-}}  # e.g. CHECK_MATCH_WIDE
  for f in "${CHECK_RESUME:-/nonexistent}"/*.json; do [[ -f $f ]] && resume+=(--resume "$f"); done
  if [[ -n ${CHECK_TUNED:-} ]]; then for d in generated/nvidia-*/; do resume+=(--resume "$d"); done; fi
  for ((i = 0; i < n; i++)); do
    kdagen check --space "$space" ${match:+--match "$match"} "${resume[@]}" --shard "$i/$n" --json "$out/check_${tag}_$i.json" \
      >"$out/check_${tag}_$i.log" 2>&1 & pids+=($!); done
  local rc=0; for i in "${pids[@]}"; do wait "$i" || rc=1; done
  grep -h "^FAIL\|passed, " "$out"/check_"${tag}"_*.log; worst "$out"/check_"${tag}"_*.json; return $rc; }
# The worst error of each kind over a check's JSON results (and which variant and case).
worst() { python3 - "$@" <<'PY'
import json, sys
rows = [r for path in sys.argv[1:] for r in json.load(open(path))]
print(f"{len(rows)} cases, {sum(bool(r['error']) for r in rows)} with errors")
keys = ("out_rel_l2", "out_max_rel", "corr_rel_l2", "corr_max_rms", "max_rel", "rel_l2")
for key in (k for k in keys if any(k in r for r in rows)):  # verify's, or commit's
    r = max(rows, key=lambda r: r.get(key) or 0.0)
    print(f"worst {key} {r.get(key)}: {r['variant']} ({r['case']})")
PY
}
has() { [[ " $steps " == *" $1 "* ]]; }
spaces=(); for name in ${COMPILE_SPACES:-}; do spaces+=(--space "$name"); done
has compile && step compile kdagen compile --arch sm_90a --jobs 16 ${COMPILE_MATCH:+--match "$COMPILE_MATCH"} "${spaces[@]}"
has check && TAIL=6 step check_verify sharded_check verify_sm90.yaml verify
has check_commit && TAIL=6 step check_commit sharded_check commit.yaml commit
has check_commit_tree && TAIL=6 step check_commit_tree sharded_check commit_tree.yaml commit_tree
has check_tree && TAIL=6 step check_tree sharded_check verify_tree_sm90.yaml tree
has check_tree_conv && TAIL=6 step check_tree_conv sharded_check verify_tree_conv_sm90.yaml tree_conv
has check_wide && TAIL=6 step check_wide sharded_check verify_wide_sm90.yaml wide
profile_check() {  # cProfile of one contract's check: the 15 costliest calls by own time, 30 by cumulative
  bounded python3 -m cProfile -o "$out/check.prof" -m kdagen.cli check --space "$1" --match "$2" &&
    python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(15)
s.sort_stats('cumtime').print_stats(30)" "$out/check.prof"; }
has profile_check && TAIL=70 step profile_check profile_check verify_sm90.yaml "${PROFILE_MATCH:-verify-h32-q8-i32-}"
has pytest && TAIL=8 step pytest_gpu bounded python3 -m pytest -m gpu -q -p no:cacheprovider --durations=20 ${PYTEST_FILES:-tests}
if has sanitize; then  # SANITIZE_VARIANTS under racecheck and memcheck, built with line info
  for tool in racecheck memcheck; do
    # torch's caching allocator off: a read or write past a tensor leaves its allocation
    TAIL=12 step "sanitize_$tool" bounded env KDAGEN_DSL_OPTIONS=--generate-line-info \
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 KDAGEN_CACHE=/tmp/kdagen-cache-lineinfo compute-sanitizer --tool "$tool" --error-exitcode 1 \
      python3 scripts/sanitize_verify.py ${SANITIZE_VARIANTS:-verify-h12-q16-i32-sm90_wgmma-t128-r1-c396-s1-pdl}
  done
fi
benches="${BENCHES:-h12_q8 h32_q4 h96_q8 h12_q2 h12_q8_conv}"
bench_verify() { local name=$1 tail=$2; shift 2; [[ " $benches " == *" $name "* ]] || return 0
  TAIL=$tail step "bench_$name" kdagen bench --space verify_sm90.yaml "$@" --out "$out/bench_verify_$name.json"; }
if has bench; then
  bench_verify h12_q8 12 --heads 12 --window 8 --batches 1,4,16,64,256,512
  bench_verify h32_q4 10 --heads 32 --window 4 --batches 1,4,16,64,256,512
  bench_verify h96_q8 8 --heads 96 --window 8 --batches 1,8,64,256
  bench_verify h12_q2 7 --heads 12 --window 2 --batches 1,16,256
  bench_verify h12_q8_conv 9 --heads 12 --window 8 --conv --batches 1,16,64,256,512
fi
if has bench_gate; then  # one tuning point, both gates side by side on the same inputs
  for shape in "32 8" "32 4" "16 8" "8 2" "4 1"; do set -- $shape
    TAIL=12 step "bench_gate_h$1_q$2" kdagen bench --space verify_sm90.yaml --gate both --heads "$1" --window "$2" \
      --match t128-r1-c396-s1 --batches 1,16,64,256,512 --no-peers --out "$out/bench_gate_h$1_q$2.json"; done
  TAIL=12 step bench_gate_h32_q8_conv kdagen bench --space verify_sm90.yaml --gate both --heads 32 --window 8 --conv \
    --match t128-r1-c396-s1 --batches 1,16,64,256,512 --no-peers --out "$out/bench_gate_h32_q8_conv.json"
fi
if has bench_tree; then  # each tree variant beside its chain twin, on the same inputs
  TAIL=20 step bench_tree kdagen bench --space verify_tree_sm90.yaml --tree both --heads 12 --window 8 \
    --batches 1,16,64,256,512 --out "$out/bench_tree_h12_q8.json"
fi
if has bench_tree_conv; then  # conv trees beside their conv chain twins (vLLM's conv layout)
  TAIL=16 step bench_tree_conv kdagen bench --space verify_tree_conv_sm90.yaml --tree both --conv --heads 12 --window 8 \
    --match tm-bf16-i32 --batches 1,16,64,256,512 --no-peers --out "$out/bench_tree_conv_h12_q8.json"
  TAIL=16 step bench_tree_conv_q16 kdagen bench --space verify_wide_sm90.yaml --tree both --conv --heads 12 --window 16 \
    --match tm-bf16-i32 --batches 1,16,64,256,512 --no-peers --out "$out/bench_tree_conv_h12_q16.json"
fi
if has bench_wide; then  # Q = 16: chains against FlashInfer, trees beside their chain twins
  TAIL=12 step bench_wide_chain kdagen bench --space verify_wide_sm90.yaml --heads 12 --window 16 \
    --batches 1,4,16,64,256,512 --out "$out/bench_wide_h12_q16.json"
  TAIL=16 step bench_wide_tree kdagen bench --space verify_wide_sm90.yaml --tree both --heads 12 --window 16 \
    --batches 1,16,64,256,512 --no-peers --out "$out/bench_wide_tree_h12_q16.json"
fi
if has bench_wide_gate; then  # Q = 16, H 32 (both models' head count): softplus beside bounded
  TAIL=12 step bench_wide_gate kdagen bench --space verify_wide_sm90.yaml --gate both --heads 32 --window 16 \
    --batches 1,16,64,256,512 --no-peers --out "$out/bench_wide_gate_h32_q16.json"
fi
if has sweep_commit; then  # every commit variant of a key on the 69-layer step (SWEEP_ARGS: the script's options)
  TAIL=40 step sweep_commit bounded python3 scripts/sweep_model_commit.py ${SWEEP_ARGS:-}
fi
if has bench_ab; then  # the same kdagen bench (AB_ARGS) in a base tree and in this one, alternating processes
  # AB_TREE: a carried, git-ignored base tree, e.g. `git archive main kdagen templates search_spaces | tar -x -C .ab`
  TAIL=16 step bench_ab bounded python3 scripts/bench_ab.py "${AB_TREE:-.ab}" . --rounds "${AB_ROUNDS:-3}" --out "$out/ab" -- \
    ${AB_ARGS:---heads 12 --window 8 --batches 1,4,16,64,256,512 --match t128-r1-c396-s1 --no-peers}
fi
if has bench_commit; then
  TAIL=10 step bench_commit_h12_q8 kdagen bench --heads 12 --window 8 --batches 1,4,16,64,256,512 --out "$out/bench_commit_h12_q8.json"
fi
if has tune; then
  mkdir -p "$out/gen" && cp -rp generated/nvidia-* "$out/gen/"  # resume: re-measure what changed
  # What this call's check (and CHECK_RESUME's) passed is timed without checking it again.
  checked=(); for f in "$out"/check_*.json "${CHECK_RESUME:-/nonexistent}"/*.json; do [[ -f $f ]] && checked+=(--checked "$f"); done
  TAIL=20 step tune kdagen tune --space verify_sm90.yaml --space verify_tree_sm90.yaml --space verify_wide_sm90.yaml --space commit.yaml --space commit_ring.yaml --jobs 16 --out "$out/gen" "${checked[@]}" ${TUNE_ARGS:-}
  cp -rp "$out"/gen/nvidia-* generated/ && tar czf "$out/gen.tgz" -C "$out/gen" .
fi
if has bench_model; then
  TAIL=8 step bench_model kdagen bench --layers 69 --heads 12 --window 8 --batches 1,16,64,256 --out "$out/bench_model_l69_h12_q8.json"
fi
if has bench_model_softplus; then
  TAIL=8 step bench_model_softplus kdagen bench --layers 20 --heads 32 --window 8 --gate softplus --batches 1,16,64,256 --out "$out/bench_model_l20_h32_q8_softplus.json"
fi
# The device machine returns at most 8 files from OUTDIR: the summary, gen.tgz, and every other
# log and JSON in one logs-<time>.tgz per call of this script.
( cd "$out" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name gen.tgz ! -name 'logs-*.tgz' \
    -print0 | tar czf "logs-$(date +%H%M%S).tgz" --null -T - --remove-files )
echo "== summary"; cat "$out/summary.txt"
