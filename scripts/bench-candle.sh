#!/usr/bin/env bash
# Keel against candle-nn's CPU ops (criterion, same groups), then the markdown
# summary in docs/report/vs_candle.md. candle is built only here (its own
# workspace under benches/candle), never by the test command.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
cargo bench --manifest-path benches/candle/Cargo.toml "$@"
mkdir -p docs/report
python3 benches/candle/summary.py > docs/report/vs_candle.md
cat docs/report/vs_candle.md
