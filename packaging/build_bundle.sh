#!/usr/bin/env bash
# Build the one-folder bundle: dist/inference-workbench/inference-workbench (double-click it, or
# run packaging/install.sh to add it to the desktop menu). One command, from a clone:
#   ./packaging/build_bundle.sh
# Uses .venv (the README's install) or $PYTHON; installs PyInstaller into it if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
  echo "No $PYTHON: run the README's install first (or set PYTHON=/path/to/python)." >&2
  exit 1
fi
"$PYTHON" -m PyInstaller --version >/dev/null 2>&1 || "$PYTHON" -m pip install -q "pyinstaller==6.22.0"
start=$(date +%s)
"$PYTHON" -m PyInstaller packaging/inference-workbench.spec --noconfirm --log-level WARN \
  --distpath dist --workpath build/pyinstaller
echo "built dist/inference-workbench in $(( $(date +%s) - start )) s, $(du -sh dist/inference-workbench | cut -f1)"
