#!/usr/bin/env bash
# The browser test's Chromium: Debian's `chromium` + `chromium-driver` (playwright drives this system browser;
# `playwright install` would download its own build, which this machine cannot reach). Needs root for apt-get.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "Chromium missing: run as root (or: sudo apt-get update && sudo apt-get install -y chromium chromium-driver)" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
/usr/bin/chromium --version
