#!/usr/bin/env bash
# Start the built bundle, load the default model, answer a short prompt and save a screenshot:
#   ./packaging/check_bundle.sh [screenshot.png]
# Offscreen by default; under a real X server (or xvfb-run) with CHECK_DISPLAY=1.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=dist/inference-workbench/inference-workbench
SHOT="${1:-dist/bundle-check.png}"
[ -x "$BUNDLE" ] || { echo "No $BUNDLE: run packaging/build_bundle.sh first." >&2; exit 1; }
if [ "${CHECK_DISPLAY:-0}" = 1 ]; then unset QT_QPA_PLATFORM; else export QT_QPA_PLATFORM=offscreen; fi
start=$(date +%s.%N)
"$BUNDLE" --self-check "$SHOT"
echo "bundle check passed in $(echo "$(date +%s.%N) - $start" | bc) s; bundle $(du -sh dist/inference-workbench | cut -f1)"
