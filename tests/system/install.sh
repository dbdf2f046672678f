#!/usr/bin/env bash
# Debian packages the system tests need: SLURM (two nodes in network namespaces), an SSH server (a DVC
# remote on the second node), podman, a browser. Idempotent; as root.
#   bash tests/system/install.sh            # everything
#   bash tests/system/install.sh slurm      # one group: slurm | ssh | containers | browser
set -uo pipefail
declare -A GROUPS_=(
  [slurm]="slurm-wlm munge"
  [ssh]="openssh-server"
  [containers]="podman runc debootstrap"
  [browser]="chromium"
)
want=("${@:-slurm ssh containers browser}")
[ "$(id -u)" = 0 ] || { echo "install.sh: not root, nothing installed"; exit 0; }
command -v apt-get >/dev/null || { echo "install.sh: no apt-get, nothing installed"; exit 0; }
pkgs=()
for g in ${want[*]}; do pkgs+=(${GROUPS_[$g]}); done
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} = 0 ] && { echo "install.sh: already installed: ${pkgs[*]}"; exit 0; }
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || echo "install.sh: apt-get update failed"
# Each package on its own, so one that cannot be had leaves the others (and their tests) working.
for p in "${missing[@]}"; do
  if apt-get install -y -qq --no-install-recommends "$p" >/dev/null 2>&1; then echo "install.sh: installed $p"
  else echo "install.sh: could not install $p"; fi
done
exit 0
