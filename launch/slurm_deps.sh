#!/usr/bin/env bash
# Sourced by launch/test.sh: installs the one-node SLURM cluster that tests/test_slurm.py starts on
# localhost (Debian/Ubuntu: slurm-wlm and munge), only where they are missing. Where apt-get, root
# or the network is missing, the install is skipped and that test skips and says why.
if ! command -v slurmd >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  SUDO=()
  [ "$(id -u)" = 0 ] || SUDO=(sudo -n)
  APT=(${SUDO[@]+"${SUDO[@]}"} env DEBIAN_FRONTEND=noninteractive
       apt-get -qq -o DPkg::Lock::Timeout=60)
  LOG=$(mktemp)
  command -v apt-get >/dev/null 2>&1 || echo "no apt-get on this machine" >"$LOG"
  # First from the package lists already there (fast), then after refreshing them.
  if command -v apt-get >/dev/null 2>&1 &&
     { "${APT[@]}" install -y --no-install-recommends slurm-wlm munge >"$LOG" 2>&1 ||
       { "${APT[@]}" update >>"$LOG" 2>&1 &&
         "${APT[@]}" install -y --no-install-recommends slurm-wlm munge >>"$LOG" 2>&1; }; }; then
    echo "installed slurm-wlm and munge for tests/test_slurm.py"
  else
    echo "note: could not install slurm-wlm and munge (last line: $(tail -n 1 "$LOG"));" \
         "tests/test_slurm.py will skip" >&2
  fi
  rm -f "$LOG"
fi
