#!/usr/bin/env bash
# Install Debian's bubblewrap, the isolation of `rollout.reward: code` (miles_rollout.sandbox), and check that it
# can create its namespaces here. Prints the executable's path. Idempotent.
set -euo pipefail
if ! command -v bwrap >/dev/null; then
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "[sandbox] bubblewrap is missing and this script can only install it as root with apt-get" >&2; exit 1
  fi
  echo "[sandbox] installing bubblewrap from Debian packages" >&2
  log_file="$(mktemp)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; } >"$log_file" 2>&1; then
    cat "$log_file" >&2; exit 1
  fi
fi
if ! bwrap --unshare-all --ro-bind /usr /usr --symlink usr/lib /lib --symlink usr/lib64 /lib64 --proc /proc \
    --dev /dev /usr/bin/true 2>/dev/null; then
  echo "[sandbox] bwrap is installed but cannot create namespaces here; use rollout.code_sandbox.tool: none" >&2
fi
command -v bwrap
