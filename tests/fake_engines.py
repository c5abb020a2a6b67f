"""Engines that crash as real ones do on a machine they cannot run on, for every machine: wrappers around the
real llama-server (named fakes; the crash is the only thing faked).

- `sigill_unless(flag)`: dies by SIGILL while loading, right after llama-server's first line (its no-GPU notice),
  as ggml's AMX kernels do on some Xeons (llama.cpp #28756), unless `flag` is on its command line; then it is
  the real llama-server.
- `sigsegv_after_first_token()`: the real llama-server, killed by SIGSEGV once it has decoded its first token
  (llama_decode called twice: the prompt, then a token), and dying by the same signal itself.
- `real()`: the real llama-server behind a wrapper (a rebuild that works).

Each writes the uid and nice value it ran at to `<wrapper>.uid`: the proof runs as the service user, never as
root, at the server's priority.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

HEADER = """\
#!/usr/bin/python3
import os, resource, signal, subprocess, sys, time, urllib.request
REAL = {real!r}
args = sys.argv[1:]
# What runs is the real llama-server without its repacked (AMX) kernels, whichever build is installed: that runs
# on every CPU, so the only crash is the one faked.
real_args = args if "--no-repack" in args else [*args, "--no-repack"]
with open(__file__ + ".uid", "w") as seen:
    seen.write(f"{{os.getuid()}} {{os.nice(0)}}")
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a fake crash leaves no core file behind


def die_by(number):
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
    time.sleep(5)
"""

SIGILL = """\
if {flag!r} in args:
    os.execv(REAL, [REAL, *real_args])
child = subprocess.Popen([REAL, *real_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for line in child.stdout:
    sys.stdout.write(line)
    sys.stdout.flush()
    child.kill()
    child.wait()
    die_by(signal.SIGILL)
sys.exit(child.wait())
"""

SIGSEGV = """\
port = args[args.index("--port") + 1]
keyed = "--api-key-file" in args
key = open(args[args.index("--api-key-file") + 1]).read().split()[0] if keyed else ""
child = subprocess.Popen([REAL, *real_args])
while child.poll() is None:
    headers = {{"Authorization": "Bearer " + key}} if key else {{}}
    request = urllib.request.Request(f"http://127.0.0.1:{{port}}/metrics", headers=headers)
    try:
        text = urllib.request.urlopen(request, timeout=2).read().decode()
    except OSError:
        time.sleep(0.05)
        continue
    decodes = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("llamacpp:n_decode_total")]
    if decodes and decodes[0] >= 2:
        child.send_signal(signal.SIGSEGV)
        child.wait()
        die_by(signal.SIGSEGV)
    time.sleep(0.01)
sys.exit(child.returncode)
"""

REAL = """\
os.execv(REAL, [REAL, *real_args])
"""

# A quarter of the machine: the real server stopped three quarters of the time (SIGSTOP, SIGCONT), as a driver
# that runs at a third of the speed would look from outside.
SLOW = """\
child = subprocess.Popen([REAL, *real_args])
signal.signal(signal.SIGTERM, lambda *_: child.terminate())
while child.poll() is None:
    time.sleep(0.01)
    child.send_signal(signal.SIGSTOP)
    time.sleep(0.03)
    child.send_signal(signal.SIGCONT)
sys.exit(child.returncode)
"""


def _write(path: Path, real: Path, body: str) -> Path:
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    path.write_text(HEADER.format(real=str(real)) + textwrap.dedent(body))
    path.chmod(0o755)
    seen = Path(f"{path}.uid")
    seen.write_text("")
    seen.chmod(0o666)  # the service user writes whom it ran as; nothing else of the directory is its
    return path


def sigill_unless(path: Path, real: Path, flag: str = "--no-repack") -> Path:
    return _write(path, real, SIGILL.format(flag=flag))


def sigsegv_after_first_token(path: Path, real: Path) -> Path:
    return _write(path, real, SIGSEGV.format())


def working(path: Path, real: Path) -> Path:
    return _write(path, real, REAL)


def slow(path: Path, real: Path) -> Path:
    return _write(path, real, SLOW)


def ran_as(wrapper: Path) -> int:
    """The uid the wrapper last ran as."""
    return int(Path(f"{wrapper}.uid").read_text().split()[0])


def ran_at(wrapper: Path) -> int:
    """The nice value the wrapper last ran at."""
    return int(Path(f"{wrapper}.uid").read_text().split()[1])
