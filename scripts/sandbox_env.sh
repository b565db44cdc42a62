#!/usr/bin/env bash
# The `python` tool's isolation (engines/tools/isolation.py): Debian's `bubblewrap` (bwrap) and libseccomp
# (`libseccomp2`, which pyseccomp loads); util-linux (setpriv, prlimit) is always there. Needs root for apt-get.
set -euo pipefail
if command -v bwrap >/dev/null && ldconfig -p | grep -q 'libseccomp\.so\.2'; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "bubblewrap/libseccomp missing: run as root (or: sudo apt-get update && sudo apt-get install -y bubblewrap libseccomp2)" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap libseccomp2 >/dev/null
bwrap --version
