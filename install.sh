#!/usr/bin/env bash
# Install llm-appliance on this machine: packages, service user, venv, llama-server, specs, units.
#   sudo ./install.sh [--demo] [--spec FILE] [--no-start]
# Where systemd is not PID 1 (containers, CI) the units cannot start: the appliance then runs in the
# foreground with `llm-appliance up`, exactly as the units would.
set -euo pipefail
cd "$(dirname "$0")"

spec="" demo=0 start=1
while [ $# -gt 0 ]; do
  case "$1" in
    --demo) demo=1 ;;
    --spec) spec="$2"; shift ;;
    --no-start) start=0 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root: sudo ./install.sh" >&2; exit 2; }
[ $demo = 1 ] && spec=etc/llm-appliance/demo.toml
[ -n "$spec" ] || spec=etc/llm-appliance/appliance.toml
[ -f "$spec" ] || { echo "install.sh: no spec at $spec" >&2; exit 2; }

step() { printf '== %s\n' "$*"; }
fail() { echo "install.sh: $*" >&2; exit 1; }
venv=/opt/llm-appliance/venv
cli=$venv/bin/llm-appliance

step "OS packages"
need=()
for p in python3-venv python3-dev cmake ninja-build g++ nftables; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q || fail "apt-get update failed; check the network and /etc/apt/sources.list"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" || fail "could not install ${need[*]}"
fi

step "service user llm-appliance"
id llm-appliance >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /var/lib/llm-appliance --shell /usr/sbin/nologin llm-appliance
install -d -m 0755 -o llm-appliance -g llm-appliance /var/lib/llm-appliance /var/lib/llm-appliance/models

step "virtualenv $venv"
[ -x $venv/bin/python ] || /usr/bin/python3 -m venv $venv
# llama-cpp-python without its own llama.cpp build: it uses the engine's libllama.
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $venv/bin/pip install -q --disable-pip-version-check . || fail "pip install failed"

step "llama-server"
$cli engine install || fail "could not provision llama-server (see above)"

if [ $demo = 1 ]; then
  step "demo models"
  $cli models fetch --dest /var/lib/llm-appliance/models || fail "could not fetch the demo models"
fi

step "specs in /etc/llm-appliance"
install -d -m 0755 /etc/llm-appliance
for f in etc/llm-appliance/*.toml; do
  # Never overwrite a spec the admin changed.
  [ -e "/etc/llm-appliance/$(basename "$f")" ] || install -m 0644 "$f" /etc/llm-appliance/
done
installed=/etc/llm-appliance/$(basename "$spec")
[ "$spec" = "$installed" ] || [ -e "$installed" ] || install -m 0644 "$spec" "$installed"

step "apply $installed"
$cli apply "$installed" || fail "apply failed (see above); nothing was started"

if [ $start = 0 ]; then
  echo "installed; not started (--no-start)"
elif [ -d /run/systemd/system ]; then
  step "start units"
  systemctl enable --now llm-appliance-server.service llm-appliance-restart.timer
  systemctl --no-pager --lines=0 status llm-appliance-server.service || true
else
  echo "systemd is not PID 1 here: the units are installed but cannot be started."
  echo "Running the appliance in the foreground instead: $cli up $installed (Ctrl-C stops it)"
  exec $cli up "$installed"
fi
