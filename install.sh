#!/usr/bin/env bash
# Install llm-appliance on this machine, from this checkout. Run it as root, or as a user with sudo.
#   ./install.sh [--demo | --spec FILE] [--root DIR] [--no-start]
#   ./install.sh --uninstall [--purge]
#   ./install.sh --hold-driver | --release-driver
# This script only bootstraps (root, OS packages, the venv); the steps live in `llm-appliance install`.
# Where systemd is not PID 1 (containers, CI machines) the units cannot start: the appliance then runs
# in the foreground with `llm-appliance up SPEC`, exactly as the units would (Ctrl-C stops it).
set -euo pipefail
cd "$(dirname "$0")"
repo=$(pwd)

original=("$@") action=install args=() start=1 root=/ purge=()
while [ $# -gt 0 ]; do
  case "$1" in
    --demo) args+=(--demo) ;;
    --spec) [ $# -ge 2 ] || { echo "install.sh: --spec needs a file" >&2; exit 2; }; args+=(--spec "$(realpath "$2")"); shift ;;
    --root) [ $# -ge 2 ] || { echo "install.sh: --root needs a directory" >&2; exit 2; }; root=$(realpath -m "$2"); shift ;;
    --no-start) start=0 ;;
    --uninstall) action=uninstall ;;
    --purge) purge=(--purge) ;;
    --hold-driver) action=hold-driver ;;
    --release-driver) action=release-driver ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "install.sh: run it as root (there is no sudo here)" >&2; exit 2; }
  exec sudo -- "$repo/install.sh" "${original[@]}"
fi
# The OS packages it needs, on one line: the fresh-machine test builds its package mirror from it.
# ccache is optional for the build; with it a rebuild of the engine (new version, new options) is quick.
os_packages=(python3-venv python3-dev cmake ninja-build g++ ccache nftables polkitd dbus)

venv=/opt/llm-appliance/venv
[ "$root" = / ] || venv=$root/opt/llm-appliance/venv
# pip's downloads and built wheels go with the appliance's other caches, so --purge leaves nothing.
export PIP_CACHE_DIR=/var/cache/llm-appliance/pip
cli=$venv/bin/llm-appliance
step() { printf '== %s\n' "$*"; }
fail() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }

if [ $action = uninstall ]; then
  [ -x "$cli" ] || fail "no installation at $venv"
  step "uninstall"
  "$cli" uninstall --root "$root" "${purge[@]}"
  rm -rf "$venv" && echo "install: removed $venv"
  rmdir "$root/opt/llm-appliance" 2>/dev/null || true
  exit 0
fi

step "OS packages"
need=()
for p in "${os_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q || fail "apt-get update failed: check the network and /etc/apt/sources.list"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" || fail "could not install ${need[*]}"
else
  echo "install: all OS packages present"
fi

step "virtualenv $venv"
[ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv" || fail "could not create $venv (python3-venv?)"
# llama-cpp-python without its own llama.cpp build: it loads the engine's libllama (one llama.cpp).
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$venv/bin/pip" install -q --disable-pip-version-check "$repo" \
  || fail "pip install failed (see above)"

if [ $action = hold-driver ] || [ $action = release-driver ]; then
  exec "$cli" "$action"
fi

step "install"
no_start=(); [ $start = 1 ] || no_start=(--no-start)
exec "$cli" install --repo "$repo" --root "$root" "${no_start[@]}" "${args[@]}"
