#!/usr/bin/env bash
# Install Debian's Chromium for the dashboard's browser tests (Playwright drives it; its own browser
# download does not work offline). Prints the executable's path. Idempotent.
set -euo pipefail
for candidate in chromium chromium-browser; do
  if command -v "$candidate" >/dev/null; then command -v "$candidate"; exit 0; fi
done
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "[browser] Chromium is missing and this script can only install it as root with apt-get" >&2; exit 1
fi
echo "[browser] installing chromium from Debian packages" >&2
log_file="$(mktemp)"
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >"$log_file" 2>&1; then
  cat "$log_file" >&2; exit 1
fi
command -v chromium
