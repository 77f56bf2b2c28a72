#!/usr/bin/env bash
# Put the built bundle in ~/.local/opt and add Inference Workbench to the desktop menu with its
# icon (xdg-desktop-menu / xdg-icon-resource when xdg-utils is there, plain copies otherwise).
#   ./packaging/install.sh            install
#   ./packaging/install.sh --remove   take it out again
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${XDG_DATA_HOME:-$HOME/.local/share}/../opt/inference-workbench"
DEST="$(realpath -m "$DEST")"
APPS="${XDG_DATA_HOME:-$HOME/.local/share}/applications"
ICONS="${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor"
DESKTOP=inference-workbench.desktop
if [ "${1:-}" = "--remove" ]; then
  if command -v xdg-desktop-menu >/dev/null; then xdg-desktop-menu uninstall --mode user "$DESKTOP" || true; fi
  rm -f "$APPS/$DESKTOP"
  for size in 16 32 48 64 128 256; do rm -f "$ICONS/${size}x${size}/apps/inference-workbench.png"; done
  rm -f "$ICONS/scalable/apps/inference-workbench.svg"
  rm -rf "$DEST"
  echo "removed"
  exit 0
fi
[ -x dist/inference-workbench/inference-workbench ] || { echo "Build it first: packaging/build_bundle.sh" >&2; exit 1; }
mkdir -p "$DEST" "$APPS"
cp -a dist/inference-workbench/. "$DEST/"
tmp=$(mktemp -d)
sed "s|^Exec=.*|Exec=$DEST/inference-workbench|" \
  "resources/$DESKTOP" > "$tmp/$DESKTOP"
if command -v xdg-desktop-menu >/dev/null && command -v xdg-icon-resource >/dev/null; then
  for size in 16 32 48 64 128 256; do
    xdg-icon-resource install --noupdate --mode user --size "$size" \
      "resources/icons/inference-workbench-$size.png" inference-workbench
  done
  xdg-icon-resource forceupdate --mode user || true
  xdg-desktop-menu install --mode user --novendor "$tmp/$DESKTOP"
else
  for size in 16 32 48 64 128 256; do
    mkdir -p "$ICONS/${size}x${size}/apps"
    cp "resources/icons/inference-workbench-$size.png" "$ICONS/${size}x${size}/apps/inference-workbench.png"
  done
  mkdir -p "$ICONS/scalable/apps"
  cp resources/icons/inference-workbench.svg "$ICONS/scalable/apps/inference-workbench.svg"
  cp "$tmp/$DESKTOP" "$APPS/$DESKTOP"
fi
rm -rf "$tmp"
echo "installed in $DEST; the menu entry is 'Inference Workbench'"
