"""What `sudo ./install.sh` does once the virtualenv exists: the service user, its directories (layout.py),
the engine, the demo models, the specs in /etc (never overwriting one the admin changed), apply, and the
units. Idempotent: every step says whether it changed anything, and a second run reports "nothing".

install.sh only bootstraps (root check, OS packages, the venv) and hands over to this module.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from appliance.ops import engine_build, layout, models
from appliance.ops.engine_ladder import ensure_proven
from appliance.ops.router_env import ensure_router
from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.apply import (
    Change,
    changes,
    installed_spec_path,
    reload_system,
    systemd_running,
    write,
)
from appliance.render.check import require_accepted
from appliance.render.render import FILES, RETIRED, render
from appliance.render.router_files import ROUTER_FILES
from appliance.spec.load import load_spec
from appliance.system import paths
from appliance.system.files import write_atomically
from appliance.system.run import run
from appliance.system.users import Account, account, trusted_status

UNITS = (paths.SERVER_UNIT, paths.HEALTH_UNIT, paths.RESTART_TIMER)
ROUTER_UNIT_FILE = Path("etc/systemd/system") / paths.ROUTER_UNIT
HOLD_PATTERNS = ("nvidia-", "libnvidia-", "cuda-", "libcuda", "libcublas", "libcudnn", "xserver-xorg-video-nvidia")
UNATTENDED_BLACKLIST = Path("/etc/apt/apt.conf.d/51llm-appliance-hold-nvidia")


def log(message: str) -> None:
    print(f"install: {message}", flush=True)


@dataclass
class Report:
    changed: list[str] = field(default_factory=list)

    def did(self, what: str) -> None:
        self.changed.append(what)
        log(what)


@dataclass(frozen=True)
class Options:
    repo: Path
    spec: Path  # the spec to apply, in the checkout or anywhere
    root: Path = Path("/")
    demo: bool = False
    start: bool = True

    @property
    def live(self) -> bool:
        return self.root == Path("/")

    def under(self, path: Path) -> Path:
        return self.root / path.relative_to("/")


def install(options: Options) -> Report:
    report = Report()
    who = ensure_user(report) if options.live else None
    layout.ensure(options.root, who, report.did)
    manifest = engine_build.install(dest=options.under(paths.ENGINE_DIR))
    log(f"engine: {manifest.binary} ({manifest.version_line})")
    if options.demo:
        # Root's directory, root's files: the service user reads the models and can change none of them.
        models.fetch(options.under(paths.MODELS), (models.SMOLLM2,), log=True)
    copy_specs(options, report, who)
    if options.live:
        prove_engine(options)
    if options.live and load_spec(options.under(paths.ETC) / options.spec.name).spec.fallback is not None:
        ensure_router(report.did)
    applied = apply_spec(options, report)
    if options.live and systemd_running():
        enable_units(options, report, restart=bool(applied))
    if not report.changed:
        log("nothing to change: the appliance is installed as specified")
    return report


def prove_engine(options: Options) -> None:
    """No engine serves before it is proven here: the installed spec's command line, as the service user. The
    ladder's choice is said once, when a proof runs; a second install finds the record holding and says so."""
    spec = options.under(paths.ETC) / options.spec.name
    record, proved = ensure_proven(validate(spec), lambda line: log(f"engine: {line}"))
    if not proved:
        log(f"engine: proven on this machine ({record.rung}, {record.proven_at}); nothing to prove")


def ensure_user(report: Report) -> Account:
    if account() is None:
        run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--home-dir",
                str(paths.LIB),
                "--shell",
                "/usr/sbin/nologin",
                paths.SERVICE_USER,
            ]
        )
        report.did(f"created the system user {paths.SERVICE_USER}")
    who = account()
    assert who is not None, f"useradd did not create {paths.SERVICE_USER}"
    return who


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_specs(options: Options, report: Report, who: Account | None = None) -> None:
    """Like dpkg's conffiles: a shipped spec is updated only while the admin has not changed it; a changed
    one is kept, and the new shipped version is written beside it as NAME.dist. The record of what was
    shipped decides whether root overwrites a spec: it is read only where the service user cannot have
    rewritten it."""
    record_path = options.under(paths.SHIPPED_RECORD)
    record = _read_record(record_path, who)
    shipped = sorted((options.repo / "etc" / "llm-appliance").glob("*.toml"))
    for source in shipped:
        target = options.under(paths.ETC) / source.name
        new_digest = _digest(source)
        if not target.exists():
            write_atomically(target, source.read_text())
            report.did(f"installed {target}")
        elif _digest(target) != new_digest:
            if record.get(source.name) == _digest(target):
                write_atomically(target, source.read_text())
                report.did(f"updated {target} (it was the shipped version)")
            else:
                dist = target.with_name(target.name + ".dist")
                if not dist.exists() or _digest(dist) != new_digest:
                    write_atomically(dist, source.read_text())
                    log(f"kept {target}: the admin changed it; the shipped version is in {dist}")
                continue
        record[source.name] = new_digest
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    if not record_path.exists() or record_path.read_text() != text:
        write_atomically(record_path, text)
    # A spec of the admin's own, given with --spec, is installed as given.
    own = options.spec.resolve()
    target = options.under(paths.ETC) / options.spec.name
    if (
        own not in {p.resolve() for p in shipped}
        and own != target.resolve()
        and (not target.exists() or _digest(target) != _digest(own))
    ):
        write_atomically(target, own.read_text())
        report.did(f"installed {target} from {own}")


def _read_record(path: Path, who: Account | None) -> dict[str, str]:
    try:
        untrusted = trusted_status(path, who) if who is not None else None
        if untrusted:
            log(f"ignored {path}: {untrusted}; specs that differ from the shipped ones are kept as the admin's")
            return {}
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in record.items()} if isinstance(record, dict) else {}


def apply_spec(options: Options, report: Report) -> list[Change]:
    spec = options.under(paths.ETC) / options.spec.name
    result = validate(spec)
    files = render(resolve(result.plan, installed_spec_path(spec)))
    require_accepted(files, lambda note: log(f"check: {note}"))
    found = changes(files, options.root)
    write(found, options.root)
    for change in found:
        report.did(f"{change.kind}d {options.root / change.path}")
    if options.live:
        for done in reload_system(found):
            log(f"ran {done}")
    return found


def enable_units(options: Options, report: Report, restart: bool) -> None:
    """Enable the units; start what is not running; restart a running server whose files changed."""
    router = (options.root / ROUTER_UNIT_FILE).is_file()
    for unit in (*UNITS, *([paths.ROUTER_UNIT] if router else [])):
        if run(["systemctl", "is-enabled", "--quiet", unit], check=False).returncode != 0:
            run(["systemctl", "enable", unit])
            report.did(f"enabled {unit}")
    if not options.start:
        return
    for unit in (paths.SERVER_UNIT, paths.RESTART_TIMER, *([paths.ROUTER_UNIT] if router else [])):
        if run(["systemctl", "is-active", "--quiet", unit], check=False).returncode != 0:
            log(f"starting {unit} (the server returns once the model is loaded)")
            run(["systemctl", "start", unit])
            report.did(f"started {unit}")
        elif restart and unit in (paths.SERVER_UNIT, paths.ROUTER_UNIT):
            run(["systemctl", "restart", unit])
            report.did(f"restarted {unit} for the new configuration")


def uninstall(root: Path = Path("/"), purge: bool = False) -> Report:
    """Units, ruleset, polkit rule, engine; /etc/llm-appliance and /var/lib/llm-appliance stay unless purge.
    The venv is removed by install.sh after this process ends."""
    report = Report()
    live = root == Path("/")
    if live and systemd_running():
        for unit in (*UNITS, paths.RESTART_UNIT, paths.ROUTER_UNIT):
            if (
                run(["systemctl", "is-enabled", "--quiet", unit], check=False).returncode == 0
                or run(["systemctl", "is-active", "--quiet", unit], check=False).returncode == 0
            ):
                run(["systemctl", "disable", "--now", unit], check=False)
                report.did(f"stopped and disabled {unit}")
    for relative in (*FILES, *ROUTER_FILES, *RETIRED):
        target = root / relative
        if target.exists():
            target.unlink()
            report.did(f"removed {target}")
    if (
        live
        and shutil.which("nft")
        and run(["nft", "list", "table", "inet", paths.NFT_TABLE], check=False).returncode == 0
    ):
        run(["nft", "delete", "table", "inet", paths.NFT_TABLE])
        report.did(f"removed the nftables table inet {paths.NFT_TABLE}")
    if live and systemd_running():
        run(["systemctl", "daemon-reload"])
    for directory in (paths.ENGINE_DIR, paths.ROUTER_VENV):
        target = root / directory.relative_to("/")
        if target.exists():
            shutil.rmtree(target)
            report.did(f"removed {target}")
    if purge:
        for directory in (paths.ETC, paths.LIB, engine_build.CACHE_DIR):
            target = root / directory.relative_to("/")
            if target.exists():
                shutil.rmtree(target)
                report.did(f"removed {target}")
        for user in (paths.ROUTER_USER, paths.SERVICE_USER):  # the router's first: it is in the other's group
            if live and run(["id", user], check=False).returncode == 0:
                run(["userdel", user])
                report.did(f"removed the user {user}")
    else:
        log(f"kept {paths.ETC}, {paths.LIB} and {engine_build.CACHE_DIR} (--purge removes them)")
    if not report.changed:
        log("nothing to remove")
    return report


def driver_packages(dpkg_listing: str) -> list[str]:
    """Installed NVIDIA driver and CUDA packages, from `dpkg-query -W -f '${Package} ${Status}\\n'`."""
    found = []
    for line in dpkg_listing.splitlines():
        name, _, status = line.partition(" ")
        if status.endswith("installed") and name.startswith(HOLD_PATTERNS):
            found.append(name)
    return sorted(found)


def hold_driver(hold: bool, blacklist: Path = UNATTENDED_BLACKLIST) -> Report:
    """Pin (or release) the NVIDIA driver and CUDA packages: apt-mark and unattended-upgrades."""
    report = Report()
    listing = run(["dpkg-query", "-W", "-f", "${Package} ${Status}\n"]).stdout
    packages = driver_packages(listing)
    if packages:
        run(["apt-mark", "hold" if hold else "unhold", *packages])
        report.did(f"{'held' if hold else 'released'} {len(packages)} packages: {' '.join(packages)}")
    else:
        log("no NVIDIA driver or CUDA packages are installed from apt: nothing to hold")
    if hold:
        text = (
            "// Written by llm-appliance install.sh --hold-driver; --release-driver removes it.\n"
            "Unattended-Upgrade::Package-Blacklist {\n" + "".join(f'    "{p}";\n' for p in HOLD_PATTERNS) + "};\n"
        )
        if not blacklist.exists() or blacklist.read_text() != text:
            write_atomically(blacklist, text)
            report.did(f"wrote {blacklist} (unattended-upgrades leaves these packages alone)")
    elif blacklist.exists():
        blacklist.unlink()
        report.did(f"removed {blacklist}")
    return report


def main_install(repo: Path, spec: Path | None, demo: bool, root: Path, start: bool) -> int:
    chosen = spec or repo / "etc" / "llm-appliance" / ("demo.toml" if demo else "appliance.toml")
    if not chosen.is_file():
        print(f"install: no spec at {chosen}; give --spec FILE", file=sys.stderr)
        return 2
    options = Options(repo=repo, spec=chosen, root=root, demo=demo, start=start)
    install(options)
    if not (options.live and options.start):
        return 0
    if systemd_running():
        run(["systemctl", "--no-pager", "--lines=0", "status", paths.SERVER_UNIT], check=False)
        log(f"running; `systemctl status {paths.SERVER_UNIT}` and `journalctl -u {paths.SERVER_UNIT}` tell how it is")
        return 0
    from appliance.health.service import up

    installed = paths.ETC / chosen.name
    print("systemd is not PID 1 here: the units are installed but cannot be started.")
    print(
        f"Running the appliance in the foreground instead, as `llm-appliance up {installed}` (Ctrl-C stops it).",
        flush=True,
    )
    result = validate(installed)
    return up(resolve(result.plan, installed), installed, stop_timeout=30.0)
