#!/usr/bin/env bash
# Checks and measures Keel's CUDA path on a GPU machine that has torch (python3)
# but no Rust toolchain, from the repo root, with the .gpu/ folder that
# scripts/gpu-bundle.sh built elsewhere (the wheel and the CUDA binaries).
#
#   bash scripts/gpu-run.sh [checks|report|bench|all|profile|verify|ab|abenv] [OUT_DIR]
#
#   checks  the machine (nvidia-smi, torch, CUDA); the Rust CUDA tests (every
#           op's CUDA kernels against the CPU kernels, and again with each of
#           the norms' other backward kernels); the rms_norm example;
#           the Python tests with the wheel (CPU and CUDA cases).
#   report  benches/report/report.py: Keel against torch eager and
#           torch.compile, CPU and CUDA, into OUT_DIR/report/; on CUDA each
#           row also has each contender's GPU kernel time per call.
#   bench   the criterion CUDA benches (device-synchronised), short runs.
#   all     the three, in that order (the default).
#   profile benches/report/profile_cuda.py: wall time against GPU kernel time
#           per call of the training cases, Keel and torch, and where their
#           CPU time goes (not in all); then the norms' fwd+bwd cases again
#           with each of their other backward kernels (KEEL_NORM_BWD=reload and
#           smem, into profile-reload.log and profile-smem.log): the A/B that
#           docs/GPU.md asks for.
#   verify  what a short lease needs after kernel changes: checks of the CUDA
#           cases alone (KEEL_PYTEST_ARGS defaults to "-k cuda"), the CUDA
#           report (KEEL_REPORT_ARGS defaults to "--devices cuda --budget
#           0.5"), and profile; about 3 minutes on the H200 of docs/GPU.md.
#           Then ab, where the bundle has a baseline.
#   abenv   this tree's wheel against itself under each assignment of
#           KEEL_AB_ENV (default "KEEL_NORM_BWD=reload KEEL_NORM_BWD=smem": the
#           norms' other backward kernels), on measure.py's CUDA rows of
#           KEEL_AB_OPS (default the norms' fwd+bwd cases), alternated as in
#           ab, into OUT_DIR/ab/NAME/AB.md (NAME: the assignment, = made -):
#           the A/B of a launch choice that main keeps off by default.
#   ab      Keel at each baseline of the bundle (gpu-bundle.sh with
#           KEEL_BASELINE="REV ..."; KEEL_AB_ONLY="NAME ..." picks some)
#           against this tree's, on this GPU: measure.py's CUDA rows (no
#           torch.compile, no decode shapes) and the per-call overhead, with
#           the two wheels in turn (KEEL_AB_ROUNDS rounds, default 2;
#           KEEL_AB_BUDGET seconds a case, default 0.3; KEEL_AB_ARGS adds
#           words to measure.py's command line, e.g. "--no-overhead", split
#           on spaces; KEEL_AB_OPS its --ops, kept whole: case names such as
#           "rms_norm fwd+bwd,softmax fwd+bwd"),
#           then benches/report/ab.py into OUT_DIR/ab/NAME/AB.md: each row's
#           new / base, and whether torch's time moved between them, for the
#           wall time and for the GPU kernel time (the one to read where the
#           row is bound by the CPU); and
#           profile_cuda.py with each wheel (OUT_DIR/ab/NAME/profile-base.log,
#           OUT_DIR/ab/profile-new.log: each kernel's time per call). Answers
#           "did this change make its row slower?" (a baseline before it) or
#           "is this variant faster?" (a branch after it) on any card; about
#           4 minutes a baseline over every op.
#
# KEEL_PYTEST_ARGS adds words to the pytest command line of checks (e.g.
# "-k cuda": the CUDA cases alone), split on spaces; KEEL_PYTEST_K a -k
# expression kept whole (e.g. "cuda and layouts").
#
# Logs go to OUT_DIR (default $OUT where set, else /tmp/keel-gpu): checks.log,
# bench.log, report.log, report/ (8 files in all), profile.log,
# profile-{reload,smem}.log. KEEL_REPORT_ARGS adds words to report.py's command line
# (e.g. "--devices cuda": the CUDA rows alone, where time is short).
# KEEL_REQUIRE_GPU=1 (the default here) turns every CUDA
# test that would skip for want of a GPU into a failure; KEEL_REQUIRE_GPU=0
# runs the same steps on a machine without one (a dry run of this script;
# KEEL_PY picks the python, e.g. a venv's).
# Each step has a time limit (KEEL_STEP_LIMIT_S scales them: 2 doubles each),
# so that one hung step cannot spend a short GPU lease; its log says how long
# each step took. Every step runs; the exit status is that of the first that
# failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
what="${1:-all}"
out="${2:-${OUT:-/tmp/keel-gpu}}"
py="${KEEL_PY:-python3}"
export KEEL_REQUIRE_GPU="${KEEL_REQUIRE_GPU:-1}" PYTHONUNBUFFERED=1
mkdir -p "$out"
for f in ops_cuda rms_norm_cuda bench_cuda rms_norm; do
  [ -x ".gpu/$f" ] || { echo "gpu-run: .gpu/$f missing: run scripts/gpu-bundle.sh where Rust is, and carry .gpu" >&2; exit 2; }
done

if [ "$what" = verify ]; then
  export KEEL_PYTEST_ARGS="${KEEL_PYTEST_ARGS:--k cuda}" KEEL_REPORT_ARGS="${KEEL_REPORT_ARGS:---devices cuda --budget 0.5}"
fi
# wants STEP: whether this run does STEP.
wants() {
  case "$what" in
    all) [[ "$1" =~ ^(checks|report|bench)$ ]] ;;
    verify) [[ "$1" =~ ^(checks|profile|report)$ ]] || { [ "$1" = ab ] && [ -d .gpu/baseline ]; } ;;
    *) [ "$what" = "$1" ] ;;
  esac
}

status=0
scale="${KEEL_STEP_LIMIT_S:-1}"
# step LOG SECONDS COMMAND...: runs COMMAND for at most SECONDS (times the
# scale), appending its output to LOG and showing it.
step() {
  local log="$1" limit; shift
  limit="$(python3 -c "print(int($1 * $scale))")"; shift
  echo "=== $* (limit ${limit}s)" | tee -a "$log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc="${PIPESTATUS[0]}"
  echo "=== ${*:1:2}: exit $rc after $((SECONDS - t0))s$([ "$rc" = 124 ] && echo ' (time limit)')" | tee -a "$log"
  if [ "$rc" != 0 ] && [ "$status" = 0 ]; then status="$rc"; fi
}

# install WHEEL: installs it beside the machine's torch, without touching
# it, into a new folder, and prints the folder.
install() {
  local site
  site="$(mktemp -d)/site"
  "$py" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$site" "$1" >&2 || return 1
  echo "$site"
}
# ab_rounds DIR BASE_ENV NEW_ENV BASE_LABEL NEW_LABEL [MEASURE_ARGS...]: measure.py's
# rows on $devices with each side's environment (VAR=value words, handed to
# env; none of them holds a space) in KEEL_AB_ROUNDS alternated rounds, into
# DIR/{base,new}-ROUND.json, then ab.py's comparison into DIR/AB.md; logs to $log.
ab_rounds() {
  local dir="$1" base_env="$2" new_env="$3" base_label="$4" new_label="$5"
  shift 5
  local base_runs=() new_runs=() round side side_env json
  mkdir -p "$dir"
  for round in $(seq "${KEEL_AB_ROUNDS:-2}"); do
    for side in base new; do
      json="$dir/$side-$round.json"
      side_env="$base_env"; [ "$side" = new ] && side_env="$new_env"
      # shellcheck disable=SC2086  # side_env: VAR=value words for env
      step "$log" 240 env $side_env "$py" benches/report/measure.py --out "$json" --devices "$devices" \
        --no-compile --decode-ops "" --budget "${KEEL_AB_BUDGET:-0.3}" --label "$side" "$@"
      if [ -f "$json" ]; then
        if [ "$side" = base ]; then base_runs+=("$json"); else new_runs+=("$json"); fi
      fi
    done
  done
  step "$log" 60 "$py" benches/report/ab.py --base "${base_runs[@]}" --new "${new_runs[@]}" \
    --base-label "$base_label" --new-label "$new_label" --out "$dir/AB.md"
}
# KEEL_AB_ARGS: extra words for measure.py, split on spaces.
# shellcheck disable=SC2206
ab_args=(${KEEL_AB_ARGS:-})

path0="${PYTHONPATH:-}"
site="$(install .gpu/keel-*.whl)" || exit 2
export PYTHONPATH="$site${path0:+:$path0}"

if wants checks; then
  log="$out/checks.log"; : > "$log"
  step "$log" 30 nvidia-smi
  step "$log" 60 "$py" -c "import torch, keel; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, 'keel', keel.LIBRARY_PATH)"
  step "$log" 60 .gpu/rms_norm_cuda --nocapture
  step "$log" 120 .gpu/ops_cuda --nocapture
  # The norms' other backward kernels (KEEL_NORM_BWD=reload, smem; held is the default).
  for keep in reload smem; do
    step "$log" 60 env KEEL_NORM_BWD=$keep .gpu/rms_norm_cuda
    step "$log" 120 env KEEL_NORM_BWD=$keep .gpu/ops_cuda cuda_matches_cpu
  done
  step "$log" 30 .gpu/rms_norm
  # pytest-xdist, where the machine has it, spreads the tests over 8 workers.
  par=()
  "$py" -c "import xdist" 2>/dev/null && par=(-n 8)
  # shellcheck disable=SC2086  # KEEL_PYTEST_ARGS: extra words for pytest
  # KEEL_PYTEST_K: a -k expression kept whole (KEEL_PYTEST_ARGS is split on spaces).
  step "$log" 240 "$py" -m pytest -q -p no:cacheprovider -rfEs "${par[@]}" ${KEEL_PYTEST_ARGS:-} \
    ${KEEL_PYTEST_K:+-k "$KEEL_PYTEST_K"} python/tests
fi
if wants report; then
  log="$out/report.log"; : > "$log"
  # shellcheck disable=SC2086  # KEEL_REPORT_ARGS: extra words for report.py, e.g. "--devices cuda" or "--ops softmax"
  # 540 s: since session 45 each CUDA row also takes its kernel times (torch.profiler).
  step "$log" 540 "$py" benches/report/report.py --out "$out/report" ${KEEL_REPORT_ARGS:-}
fi
if wants bench; then
  log="$out/bench.log"; : > "$log"
  step "$log" 150 .gpu/bench_cuda --bench --warm-up-time 0.1 --measurement-time 0.3
fi
if wants profile; then
  log="$out/profile.log"; : > "$log"
  step "$log" 120 "$py" benches/report/profile_cuda.py
  # The norms' backward with each of its other kernels (*_bwd2_*, *_bwd_*
  # for reload; *_bwd2s_* for smem), the same cases: their kernel times
  # against the default's (*_bwd2h_*, *_bwd4h_f32) just above.
  for keep in reload smem; do
    log="$out/profile-$keep.log"; : > "$log"
    step "$log" 90 env KEEL_NORM_BWD=$keep "$py" benches/report/profile_cuda.py \
      --ops "rms_norm fwd+bwd,layer_norm fwd+bwd,fused_add_rms_norm fwd+bwd" --dtypes bfloat16,float32
  done
fi
if wants abenv; then
  # This tree's wheel against itself under each of KEEL_AB_ENV's assignments
  # (default: the norms' other backward kernels), on the norms' training
  # cases unless KEEL_AB_OPS says otherwise: the A/B of a launch choice.
  log="$out/abenv.log"; : > "$log"
  new_rev="$(cat .gpu/REV 2>/dev/null || echo new)"
  devices=cuda; [ "$KEEL_REQUIRE_GPU" = 1 ] || devices=cpu
  ops="${KEEL_AB_OPS:-rms_norm fwd+bwd,layer_norm fwd+bwd,fused_add_rms_norm fwd+bwd}"
  for assign in ${KEEL_AB_ENV:-KEEL_NORM_BWD=reload KEEL_NORM_BWD=smem}; do
    ab_rounds "$out/ab/${assign//=/-}" "" "$assign" "$new_rev" "$new_rev $assign" \
      --no-overhead --ops "$ops" "${ab_args[@]}"
  done
fi
if wants ab; then
  log="$out/ab.log"; : > "$log"
  # The baselines: every wheel gpu-bundle.sh put under .gpu/baseline, or
  # those KEEL_AB_ONLY names.
  bases=()
  for d in .gpu/baseline/*/; do [ -d "$d" ] && bases+=("$(basename "$d")"); done
  # shellcheck disable=SC2206  # KEEL_AB_ONLY: names, split on spaces
  [ -n "${KEEL_AB_ONLY:-}" ] && bases=(${KEEL_AB_ONLY})
  if [ "${#bases[@]}" = 0 ]; then
    echo "gpu-run: ab: no wheel under .gpu/baseline: run gpu-bundle.sh with KEEL_BASELINE=REV" | tee -a "$log"
    [ "$status" = 0 ] && status=2
  fi
  new_rev="$(cat .gpu/REV 2>/dev/null || echo new)"
  # Where KEEL_REQUIRE_GPU=0 (a dry run without a GPU), the CPU rows instead.
  devices=cuda; [ "$KEEL_REQUIRE_GPU" = 1 ] || devices=cpu
  # profile_cuda.py: each kernel's time per call in the training cases (about
  # 10 s on a GPU; small shapes in a dry run).
  profile=(--device "$devices"); [ "$devices" = cpu ] && profile+=(--size small)
  for name in "${bases[@]}"; do
    dir="$out/ab/$name"; mkdir -p "$dir"
    base_whl="$(ls .gpu/baseline/"$name"/keel-*.whl 2>/dev/null)"
    if [ -z "$base_whl" ]; then
      echo "gpu-run: ab: no wheel in .gpu/baseline/$name" | tee -a "$log"
      [ "$status" = 0 ] && status=2
      continue
    fi
    base_site="$(install "$base_whl")" || exit 2
    ab_rounds "$dir" "PYTHONPATH=$base_site${path0:+:$path0}" "PYTHONPATH=$site${path0:+:$path0}" \
      "$(cat .gpu/baseline/"$name"/REV)" "$new_rev" "${ab_args[@]}" ${KEEL_AB_OPS:+--ops "$KEEL_AB_OPS"}
    step "$dir/profile-base.log" 120 env PYTHONPATH="$base_site${path0:+:$path0}" "$py" \
      benches/report/profile_cuda.py "${profile[@]}"
  done
  if [ "${#bases[@]}" != 0 ]; then
    step "$out/ab/profile-new.log" 120 "$py" benches/report/profile_cuda.py "${profile[@]}"
  fi
fi
exit "$status"
