#!/usr/bin/env bash
# Keel against candle-nn's CPU ops (criterion, same groups), then the markdown
# summary in docs/report/vs_candle.md. candle is built only here (its own
# workspace under benches/candle), never by the test command.
#
#   scripts/bench-candle.sh [--out DIR] [criterion options...]
#
# --out DIR writes DIR/vs_candle.md instead (e.g. docs/report/xeon-avx512, the
# report of another machine); the other arguments go to criterion.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out=docs/report
if [ "${1:-}" = "--out" ]; then
  out="$2"
  shift 2
fi
cargo bench --manifest-path benches/candle/Cargo.toml "$@"
mkdir -p "$out"
python3 benches/candle/summary.py > "$out/vs_candle.md"
cat "$out/vs_candle.md"
