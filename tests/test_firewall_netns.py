"""The rendered nftables ruleset, loaded for real in network namespaces joined by veth links.

Topology (every namespace and link is created here and deleted at the end; nothing leaves them):

    CLIENT_OK  10.77.1.2 fd77:1::2 ──veth── 10.77.1.1 fd77:1::1 ┐
    CLIENT_BAD 10.77.2.2 fd77:2::2 ──veth── 10.77.2.1 fd77:2::1 ├ SRV (the appliance host, ruleset loaded here)
    OUTSIDE    10.77.3.2 fd77:3::2 ──veth── 10.77.3.1 fd77:3::1 ┘

network.allow holds CLIENT_OK's networks and loopback only. In SRV, the API and exporter ports are served
by a process running as the service user (as llama-server and the exporter are), and port 8000 (outside the
ruleset's ports) by root, and a DNS resolver answers on 127.0.0.53:53 (UDP), where systemd-resolved listens.
OUTSIDE runs an HTTP server the service user must not reach while egress is denied.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import EXAMPLE_FACTS, EXAMPLES, INSTALLED_MODELS, KeyFile

from appliance.plan.resolved import resolve
from appliance.plan.validate import validate
from appliance.render.render import render
from appliance.system import paths

pytestmark = pytest.mark.system

NFT_FILE = "etc/llm-appliance/rendered/llm-appliance.nft"
TABLE = paths.NFT_TABLE
API_PORT = 8080  # demo.toml's server.port
EXPORTER_PORT = 9478  # demo.toml's prometheus.port
OPEN_PORT = 8000  # not one of the ruleset's ports: answers everyone
OUTSIDE_PORT = 8081
# Nothing on a veth answers slower than this; a drop is "no answer within it" (curl exit 28).
TIMEOUT_S = 2
CURL_TIMEOUT = 28
INPUT_DROP = "llm-appliance: client not in network.allow"
EGRESS_DROP = "llm-appliance: egress denied"
ADMIN_TABLE = "table inet admin {\n\tchain c {\n\t\ttype filter hook input priority 0; policy accept;\n\t}\n}\n"

SRV_V4, OK_V4, BAD_V4, OUT_V4 = "10.77.1.1", "10.77.1.2", "10.77.2.2", "10.77.3.2"
SRV_V6, OK_V6, BAD_V6, OUT_V6 = "fd77:1::1", "fd77:1::2", "fd77:2::2", "fd77:3::2"
SRV_BAD_V4, SRV_BAD_V6 = "10.77.2.1", "fd77:2::1"
ALLOW = ["10.77.1.0/24", "fd77:1::/64", "127.0.0.0/8", "::1/128"]
ALLOW_NO_LOOPBACK = ["10.77.1.0/24", "fd77:1::/64"]  # loopback must work all the same

# A tiny HTTP server on [::]:PORT (dual stack) that says who it is, as which uid, and whom it saw;
# it appends every client it answers to HITS.
SERVER = r"""
import http.server, os, socket, sys
name, port, hits = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        client = self.client_address[0].removeprefix("::ffff:")
        if hits != "-":
            with open(hits, "a") as f:
                f.write(client + "\n")
        body = f"{name} uid={os.getuid()} client={client}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

class Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6
    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

Server(("::", port), Handler).serve_forever()
"""


RESOLVER = ("127.0.0.53", 53)
# A stub DNS resolver: answers every query with one A record (192.0.2.1) and appends who asked to HITS.
RESOLVER_SERVER = r"""
import socket, struct, sys
host, port, hits = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind((host, port))
while True:
    query, client = sock.recvfrom(512)
    with open(hits, "a") as f:
        f.write(f"{client[0]}\n")
    question = query[12:]
    header = query[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0)
    answer = struct.pack(">HHHIH", 0xC00C, 1, 1, 60, 4) + socket.inet_aton("192.0.2.1")
    sock.sendto(header + question + answer, client)
"""
# One query for example.com A, as a stub resolver sends it; prints what came back.
RESOLVER_CLIENT = r"""
import errno, socket, struct, sys
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
query = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"\x07example\x03com\x00" + struct.pack(">HH", 1, 1)
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(timeout)
try:
    sock.sendto(query, (host, port))
    reply = sock.recv(512)
except TimeoutError:
    print("timeout")
except OSError as exc:
    print(f"failed {errno.errorcode.get(exc.errno, exc.errno)}")
else:
    print("answer " + socket.inet_ntoa(reply[-4:]) if reply[:2] == query[:2] else "garbled")
"""


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")
    if found is None:
        pytest.fail(f"{name} is not installed (.ci/run installs it)")
    return found


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _check(argv: list[str]) -> str:
    result = _run(argv)
    assert result.returncode == 0, f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr}"
    return result.stdout


def _as_service_user(user: str = paths.SERVICE_USER) -> list[str]:
    return [_tool("setpriv"), "--reuid", user, "--regid", user, "--clear-groups"]


@dataclass
class Net:
    srv: str
    ok: str
    bad: str
    outside: str
    tmp: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def namespaces(self) -> list[str]:
        return [self.srv, self.ok, self.bad, self.outside]

    @property
    def outside_hits(self) -> Path:
        return self.tmp / "outside-hits"

    @property
    def resolver_hits(self) -> Path:
        return self.tmp / "resolver-hits"

    def resolve(self, as_user: bool = False) -> str:
        """One DNS query to the resolver on 127.0.0.53 from SRV: 'answer 192.0.2.1', 'timeout' or 'failed ERRNO'."""
        user = _as_service_user() if as_user else []
        argv = [*user, sys.executable, "-c", RESOLVER_CLIENT, *map(str, RESOLVER), str(TIMEOUT_S)]
        return _check([_tool("ip"), "netns", "exec", self.srv, *argv]).strip()

    def exec(self, ns: str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return _run([_tool("ip"), "netns", "exec", ns, *argv], timeout)

    def curl(
        self, ns: str, host: str, port: int, as_user: bool = False, user_name: str = paths.SERVICE_USER
    ) -> subprocess.CompletedProcess[str]:
        url = f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
        user = _as_service_user(user_name) if as_user else []
        argv = [*user, _tool("curl"), "-sS", "-g", "--noproxy", "*", "--max-time", str(TIMEOUT_S), url]
        return self.exec(ns, argv, timeout=TIMEOUT_S + 10)

    def nft(self, *args: str) -> str:
        return _check([_tool("ip"), "netns", "exec", self.srv, _tool("nft"), *args])

    def load(self, ruleset: str, name: str) -> None:
        path = self.tmp / name
        path.write_text(ruleset)
        self.nft("-f", str(path))

    def tables(self) -> set[str]:
        listed = json.loads(self.nft("-j", "list", "tables"))["nftables"]
        return {f"{t['table']['family']} {t['table']['name']}" for t in listed if "table" in t}

    def listing(self, table: str = TABLE) -> list[dict[str, object]]:
        return json.loads(self.nft("-j", "list", "table", "inet", table))["nftables"]  # type: ignore[no-any-return]

    def counter(self, comment: str) -> int:
        """Packets counted by the rule with this comment."""
        for item in self.listing():
            rule = item.get("rule")
            if isinstance(rule, dict) and rule.get("comment") == comment:
                return sum(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
        raise AssertionError(f"no rule with comment {comment!r} in table inet {TABLE}")

    def serve(self, ns: str, name: str, port: int, hits: str = "-", as_user: bool = False) -> None:
        user = _as_service_user() if as_user else []
        argv = [_tool("ip"), "netns", "exec", ns, *user, sys.executable, "-c", SERVER, name, str(port), hits]
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.processes.append(process)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(
                    f"the {name} server in {ns} exited: {process.stderr.read().decode() if process.stderr else ''}"
                )
            # Loopback inside its own namespace: no rule of ours stops it.
            if (
                self.exec(
                    ns, [_tool("curl"), "-s", "--noproxy", "*", "--max-time", "1", f"http://127.0.0.1:{port}/"]
                ).returncode
                == 0
            ):
                return
            time.sleep(0.05)
        pytest.fail(f"the {name} server in {ns} did not answer on port {port}")


def _link(net: Net, a: str, a_if: str, a_addrs: tuple[str, str], b: str, b_if: str, b_addrs: tuple[str, str]) -> None:
    """A veth pair created directly inside the two namespaces (nothing in the host's namespace)."""
    ip = _tool("ip")
    _check([ip, "link", "add", a_if, "netns", a, "type", "veth", "peer", "name", b_if, "netns", b])
    for ns, ifname, (v4, v6) in ((a, a_if, a_addrs), (b, b_if, b_addrs)):
        _check([ip, "-n", ns, "addr", "add", f"{v4}/24", "dev", ifname])
        _check([ip, "-n", ns, "addr", "add", f"{v6}/64", "dev", ifname, "nodad"])
        _check([ip, "-n", ns, "link", "set", ifname, "up"])


@pytest.fixture(scope="module")
def service_user() -> str:
    """nft resolves `meta skuid "llm-appliance"` (and the router's user) at load time, and the servers run as
    that user."""
    for user in (paths.SERVICE_USER, paths.ROUTER_USER):
        if _run(["id", user]).returncode != 0:
            _check([_tool("useradd"), "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user])
    return paths.SERVICE_USER


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory, service_user: str) -> Iterator[Net]:
    ip = _tool("ip")
    prefix = f"lla-{os.getpid()}"
    tmp = tmp_path_factory.mktemp("netns")
    net = Net(f"{prefix}-srv", f"{prefix}-ok", f"{prefix}-bad", f"{prefix}-out", tmp)
    probe = _run([ip, "netns", "add", net.srv])
    if probe.returncode != 0:
        if os.geteuid() != 0 or "Operation not permitted" in probe.stderr or "Permission denied" in probe.stderr:
            pytest.skip(f"`ip netns add` is not permitted here (needs root / CAP_NET_ADMIN): {probe.stderr.strip()}")
        pytest.fail(f"ip netns add {net.srv} failed: {probe.stderr}")
    created = [net.srv]
    try:
        for ns in net.namespaces[1:]:
            _check([ip, "netns", "add", ns])
            created.append(ns)
        for ns in net.namespaces:
            _check([ip, "-n", ns, "link", "set", "lo", "up"])
        _link(net, net.srv, "to-ok", (SRV_V4, SRV_V6), net.ok, "srv0", (OK_V4, OK_V6))
        _link(net, net.srv, "to-bad", (SRV_BAD_V4, SRV_BAD_V6), net.bad, "srv0", (BAD_V4, BAD_V6))
        _link(net, net.srv, "to-out", ("10.77.3.1", "fd77:3::1"), net.outside, "srv0", (OUT_V4, OUT_V6))
        net.serve(net.srv, "api", API_PORT, as_user=True)
        net.serve(net.srv, "exporter", EXPORTER_PORT, as_user=True)
        net.serve(net.srv, "open", OPEN_PORT)
        net.serve(net.outside, "outside", OUTSIDE_PORT, hits=str(net.outside_hits))
        resolver = [sys.executable, "-c", RESOLVER_SERVER, *map(str, RESOLVER), str(net.resolver_hits)]
        net.processes.append(
            subprocess.Popen(
                [_tool("ip"), "netns", "exec", net.srv, *resolver],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
        deadline = time.monotonic() + 10
        while net.resolve() != "answer 192.0.2.1":  # before any ruleset: the resolver answers
            assert time.monotonic() < deadline, "the stub resolver on 127.0.0.53 does not answer"
            time.sleep(0.05)
        yield net
    finally:
        for process in net.processes:
            process.terminate()
        for process in net.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
            if process.stderr:
                process.stderr.close()
        for ns in created:
            _run([ip, "netns", "delete", ns])


def _tree(
    directory: Path,
    fixture_models: Path,
    egress: str,
    allow: list[str],
    keys: Path,
    more: str = "",
    private: bool = False,
) -> dict[str, str]:
    """The real rendered tree of demo.toml made network-facing for these networks, `more` TOML appended."""
    text = (EXAMPLES / "demo.toml").read_text().replace(INSTALLED_MODELS, str(fixture_models))
    for old, new in {
        'host = "127.0.0.1"': f'host = "0.0.0.0"\napi_key_file = "{keys}"',
        'allow = ["127.0.0.0/8", "::1/128"]': f"allow = {json.dumps(allow)}",
        'egress = "deny"': f'egress = "{egress}"' + ("\nprivate = true" if private else ""),
    }.items():
        assert old in text, f"{old!r} not in demo.toml"
        text = text.replace(old, new)
    spec = directory / "demo.toml"
    spec.write_text(text + more)
    result = validate(spec, facts=EXAMPLE_FACTS["demo.toml"])
    return render(resolve(result.plan, paths.ETC / "demo.toml"))


def _ruleset(directory: Path, fixture_models: Path, egress: str, allow: list[str], keys: Path, more: str = "") -> str:
    return _tree(directory, fixture_models, egress, allow, keys, more)[NFT_FILE]


# A fallback upstream in OUTSIDE, by its IPv4 address: the router may dial that address and port, nothing else.
FALLBACK = f"""
[fallback]
base_url = "http://{OUT_V4}:{OUTSIDE_PORT}/v1"
model = "upstream-model"
"""


@pytest.fixture(scope="module")
def rulesets(
    tmp_path_factory: pytest.TempPathFactory, fixture_models: Path, service_user: str, key_file: KeyFile
) -> dict[str, str]:
    keys = key_file("a-key")
    return {
        "deny": _ruleset(tmp_path_factory.mktemp("deny"), fixture_models, "deny", ALLOW, keys),
        "allow": _ruleset(tmp_path_factory.mktemp("allow"), fixture_models, "allow", ALLOW, keys),
        "deny-no-loopback": _ruleset(
            tmp_path_factory.mktemp("no-loopback"), fixture_models, "deny", ALLOW_NO_LOOPBACK, keys
        ),
        "fallback": _ruleset(tmp_path_factory.mktemp("fallback"), fixture_models, "deny", ALLOW, keys, FALLBACK),
    }


@pytest.fixture
def srv(net: Net, rulesets: dict[str, str]) -> Net:
    """SRV with an empty ruleset, then the admin's own table, then ours (egress denied)."""
    net.nft("flush", "ruleset")
    net.load(ADMIN_TABLE, "admin.nft")
    net.load(rulesets["deny"], "llm-appliance.nft")
    net.outside_hits.unlink(missing_ok=True)
    net.resolver_hits.unlink(missing_ok=True)
    return net


def _answered_by(result: subprocess.CompletedProcess[str], name: str) -> str:
    assert result.returncode == 0, f"curl exit {result.returncode}: {result.stderr}"
    assert result.stdout.startswith(f"{name} "), result.stdout
    return result.stdout


def _dropped(result: subprocess.CompletedProcess[str]) -> None:
    # 28: nothing came back before the timeout. 7 (refused) would mean a reset, not a drop.
    assert result.returncode == CURL_TIMEOUT, (
        f"curl exit {result.returncode}, expected a timeout: {result.stdout}{result.stderr}"
    )
    assert result.stdout == ""


# --- ingress ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("client", "server"), [(OK_V4, SRV_V4), (OK_V6, SRV_V6)], ids=["v4", "v6"])
def test_allowed_client_gets_a_response(srv: Net, client: str, server: str) -> None:
    uid = _check(["id", "-u", paths.SERVICE_USER]).strip()
    for name, port in (("api", API_PORT), ("exporter", EXPORTER_PORT)):
        # Served by the service user while its egress is denied: the replies still flow.
        body = _answered_by(srv.curl(srv.ok, server, port), name)
        assert f"uid={uid} client={client}\n" in body


@pytest.mark.parametrize(("client", "server"), [(BAD_V4, SRV_BAD_V4), (BAD_V6, SRV_BAD_V6)], ids=["v4", "v6"])
def test_disallowed_client_gets_nothing(srv: Net, client: str, server: str) -> None:
    # CLIENT_BAD reaches SRV: a port the ruleset does not cover answers it.
    assert f"client={client}\n" in _answered_by(srv.curl(srv.bad, server, OPEN_PORT), "open")
    before = srv.counter(INPUT_DROP)
    for port in (API_PORT, EXPORTER_PORT):
        _dropped(srv.curl(srv.bad, server, port))
    assert srv.counter(INPUT_DROP) >= before + 2  # at least one SYN per port


def test_allowed_client_cannot_use_the_other_address(srv: Net) -> None:
    """The allow list is about the client's address, not the interface it arrives on."""
    _answered_by(srv.curl(srv.ok, SRV_V4, API_PORT), "api")
    # CLIENT_BAD asks for SRV's address on CLIENT_OK's link: still not allowed.
    _check([_tool("ip"), "-n", srv.bad, "route", "replace", f"{SRV_V4}/32", "via", SRV_BAD_V4])
    try:
        _dropped(srv.curl(srv.bad, SRV_V4, API_PORT))
    finally:
        _check([_tool("ip"), "-n", srv.bad, "route", "del", f"{SRV_V4}/32"])


# --- egress ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outside", [OUT_V4, OUT_V6], ids=["v4", "v6"])
def test_service_user_cannot_reach_outside_while_egress_denied(srv: Net, outside: str) -> None:
    before = srv.counter(EGRESS_DROP)
    _dropped(srv.curl(srv.srv, outside, OUTSIDE_PORT, as_user=True))
    assert srv.counter(EGRESS_DROP) > before
    assert not srv.outside_hits.exists(), "OUTSIDE saw a request from the service user"
    # The test host is reachable: root gets through, so the rule is what stops the service user.
    _answered_by(srv.curl(srv.srv, outside, OUTSIDE_PORT), "outside")
    assert srv.outside_hits.read_text().count("\n") == 1


@pytest.mark.parametrize("ruleset", ["deny", "deny-no-loopback"])
@pytest.mark.parametrize("loopback", ["127.0.0.1", "::1", SRV_BAD_V4], ids=["v4", "v6", "own-address"])
def test_service_user_reaches_the_appliance_ports_on_loopback(
    srv: Net, rulesets: dict[str, str], ruleset: str, loopback: str
) -> None:
    """The health daemon (the service user) talks to the server over loopback, egress denied or not,
    whether or not network.allow names loopback (SRV's own non-loopback addresses are routed over lo too);
    any other port there is as closed to it as the outside."""
    srv.load(rulesets[ruleset], f"{ruleset}.nft")
    before = srv.counter(EGRESS_DROP)
    for name, port in (("api", API_PORT), ("exporter", EXPORTER_PORT)):
        _answered_by(srv.curl(srv.srv, loopback, port, as_user=True), name)
    assert srv.counter(EGRESS_DROP) == before
    _dropped(srv.curl(srv.srv, loopback, OPEN_PORT, as_user=True))
    assert srv.counter(EGRESS_DROP) > before
    _answered_by(srv.curl(srv.srv, loopback, OPEN_PORT), "open")  # root: the rule is what stops the user


def test_service_user_cannot_query_a_local_resolver(srv: Net) -> None:
    """DNS is a way out too: a resolver on loopback forwards whatever names it is asked (exfiltration)."""
    before = srv.counter(EGRESS_DROP)
    # A datagram the output hook drops fails at sendto (EPERM): it never left the socket.
    assert srv.resolve(as_user=True) == "failed EPERM"
    assert srv.counter(EGRESS_DROP) > before
    assert not srv.resolver_hits.exists(), "the resolver saw a query from the service user"
    # The resolver answers root, and the service user still reaches the server on loopback.
    assert srv.resolve() == "answer 192.0.2.1"
    assert srv.resolver_hits.read_text() == "127.0.0.1\n"
    _answered_by(srv.curl(srv.srv, "127.0.0.1", API_PORT, as_user=True), "api")


def test_egress_allow_lets_the_service_user_resolve(srv: Net, rulesets: dict[str, str]) -> None:
    srv.load(rulesets["allow"], "llm-appliance-allow.nft")
    assert srv.resolve(as_user=True) == "answer 192.0.2.1"


def test_egress_allow_lets_the_service_user_out(srv: Net, rulesets: dict[str, str]) -> None:
    srv.load(rulesets["allow"], "llm-appliance-allow.nft")  # replaces the denying table in place
    chains = {item["chain"]["name"] for item in srv.listing() if "chain" in item}  # type: ignore[index]
    # No egress filter: the output hook only keeps the appliance's ports its own.
    assert chains == {"input", "output", "own_ports"}
    for outside in (OUT_V4, OUT_V6):
        _answered_by(srv.curl(srv.srv, outside, OUTSIDE_PORT, as_user=True), "outside")
    _answered_by(srv.curl(srv.srv, "127.0.0.1", API_PORT, as_user=True), "api")
    # Ingress is filtered the same.
    _answered_by(srv.curl(srv.ok, SRV_V4, API_PORT), "api")
    _dropped(srv.curl(srv.bad, SRV_BAD_V4, API_PORT))


# --- the router ([fallback]) and private code ------------------------------------------------------------


def test_the_router_dials_its_upstream_and_nothing_else(srv: Net, rulesets: dict[str, str]) -> None:
    srv.load(rulesets["fallback"], "llm-appliance-fallback.nft")
    router = paths.ROUTER_USER
    before = srv.counter(EGRESS_DROP)
    _answered_by(srv.curl(srv.srv, OUT_V4, OUTSIDE_PORT, as_user=True, user_name=router), "outside")
    for name, port in (("api", API_PORT), ("exporter", EXPORTER_PORT)):  # the local server and daemon
        _answered_by(srv.curl(srv.srv, "127.0.0.1", port, as_user=True, user_name=router), name)
    assert srv.counter(EGRESS_DROP) == before
    # The upstream's other address, another port on loopback: as closed to the router as to anyone of ours.
    _dropped(srv.curl(srv.srv, OUT_V6, OUTSIDE_PORT, as_user=True, user_name=router))
    _dropped(srv.curl(srv.srv, "127.0.0.1", OPEN_PORT, as_user=True, user_name=router))
    # llama-server's user never reaches the upstream: only the router holds the way out (and its key).
    _dropped(srv.curl(srv.srv, OUT_V4, OUTSIDE_PORT, as_user=True))
    assert srv.outside_hits.read_text().count("\n") == 1  # the router's one request


def test_private_code_renders_no_router_and_the_upstream_stays_unreachable(
    srv: Net, tmp_path: Path, fixture_models: Path, key_file: KeyFile
) -> None:
    tree = _tree(tmp_path, fixture_models, "deny", ALLOW, key_file("a-key"), private=True)
    assert not [path for path in tree if "router" in path], sorted(tree)
    srv.load(tree[NFT_FILE], "llm-appliance-private.nft")
    _dropped(srv.curl(srv.srv, OUT_V4, OUTSIDE_PORT, as_user=True))
    assert not srv.outside_hits.exists(), "OUTSIDE saw a request from the appliance"


# --- its own table ---------------------------------------------------------------------------------------


def _shape(listing: list[dict[str, object]]) -> list[object]:
    """The table's contents without handles and counters, to compare two loads."""

    def strip(value: object) -> object:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("handle", "counter")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return [strip(item) for item in listing if "metainfo" not in item]


def test_loading_twice_keeps_the_admin_table_and_one_copy(srv: Net, rulesets: dict[str, str]) -> None:
    assert srv.tables() == {"inet admin", f"inet {TABLE}"}
    first = _shape(srv.listing())
    srv.load(rulesets["deny"], "again.nft")
    assert srv.tables() == {"inet admin", f"inet {TABLE}"}
    assert _shape(srv.listing()) == first  # replaced, not appended to
    rules = [item for item in srv.listing() if "rule" in item]
    assert len(rules) == 10, rules  # 4 input + 4 output + 2 own_ports: one copy
    admin = srv.listing("admin")
    assert [item["chain"]["name"] for item in admin if "chain" in item] == ["c"]  # type: ignore[index]
    # Still working after the reload.
    _answered_by(srv.curl(srv.ok, SRV_V4, API_PORT), "api")
    _dropped(srv.curl(srv.bad, SRV_BAD_V4, API_PORT))


def test_removal_leaves_the_admin_table(srv: Net) -> None:
    srv.nft("delete", "table", "inet", TABLE)
    assert srv.tables() == {"inet admin"}
    assert "chain c" in srv.nft("list", "table", "inet", "admin")
    # Nothing of ours is left filtering.
    _answered_by(srv.curl(srv.bad, SRV_BAD_V4, API_PORT), "api")
    _answered_by(srv.curl(srv.srv, OUT_V4, OUTSIDE_PORT, as_user=True), "outside")


# --- the appliance's ports are its own -------------------------------------------------------------------

ROUTER_PORT = 8000  # [fallback] port's default
THE_KEY = "sk-the-api-key-a-squatter-wants"
# A listener as anyone may run one on a free port >= 1024: it prints (in hex) every byte a client sends it.
SQUATTER = r"""
import socket, sys
port = int(sys.argv[1])
server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("::", port))
server.listen(64)
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.settimeout(2)
    try:
        data = conn.recv(65536)
    except OSError:
        data = b""
    print(data.hex(), flush=True)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    conn.close()
"""
# The one client that sends the key (runtime/server_api.py), as the daemon, the launcher and `status` call it.
KEY_CLIENT = r"""
import sys
from appliance.runtime.server_api import ServerApi, ServerUnreachable
try:
    print("answered", ServerApi(sys.argv[1], sys.argv[2], timeout=float(sys.argv[3])).health())
except ServerUnreachable as exc:
    print("unreachable", exc)
"""


@pytest.fixture
def lone(service_user: str) -> Iterator[str]:
    """A namespace of its own, loopback only: every port in it is free, as the server's is while it restarts."""
    ip = _tool("ip")
    name = f"lla-{os.getpid()}-lone"
    if _run([ip, "netns", "add", name]).returncode != 0:
        pytest.skip("`ip netns add` is not permitted here (needs root / CAP_NET_ADMIN)")
    try:
        _check([ip, "-n", name, "link", "set", "lo", "up"])
        yield name
    finally:
        _run([ip, "netns", "delete", name])


class Listener:
    """A SQUATTER in a namespace, as `user`: what it was sent comes back when it is stopped."""

    def __init__(self, ns: str, user: str, port: int) -> None:
        group = _check(["id", "-gn", user]).strip()
        argv = [_tool("setpriv"), "--reuid", user, "--regid", group, "--clear-groups"]
        self.process = subprocess.Popen(
            [_tool("ip"), "netns", "exec", ns, *argv, sys.executable, "-c", SQUATTER, str(port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline() != "listening\n":
            self.stop()
            pytest.fail(f"the listener as {user} did not start: {self.process.stderr}")

    def stop(self) -> bytes:
        """Everything it received."""
        self.process.kill()
        out, _ = self.process.communicate()
        return b"".join(bytes.fromhex(line) for line in out.split())


def _send_key(ns: str, port: int, as_user: bool, host: str = "127.0.0.1") -> str:
    user = _as_service_user() if as_user else []
    env = ["env", f"PYTHONPATH={Path(__file__).resolve().parent.parent}"]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    argv = [_tool("ip"), "netns", "exec", ns, *user, *env, sys.executable, "-c", KEY_CLIENT, url, THE_KEY, "2"]
    return _check(argv).strip()


@pytest.mark.parametrize(
    ("ruleset", "port", "owner"),
    [
        ("deny", API_PORT, paths.SERVICE_USER),
        ("allow", API_PORT, paths.SERVICE_USER),
        ("deny", EXPORTER_PORT, paths.SERVICE_USER),
        ("fallback", ROUTER_PORT, paths.ROUTER_USER),
    ],
    ids=["api", "api-egress-allow", "exporter", "router"],
)
def test_a_local_user_squatting_a_port_gets_no_key(
    lone: str, rulesets: dict[str, str], tmp_path: Path, ruleset: str, port: int, owner: str
) -> None:
    """While the server restarts its port is free: `nobody` listens there. Without the ruleset, the daemon's and
    root's request hands it the API key (the attack); with it, the handshake never completes, and the port's own
    user still answers once it listens again."""
    squatter = Listener(lone, "nobody", port)
    try:
        assert _send_key(lone, port, as_user=False).startswith("answered")
    finally:
        received = squatter.stop()
    assert THE_KEY.encode() in received, "the attack itself failed: no key reached the squatter"
    (tmp_path / ruleset).write_text(rulesets[ruleset])
    _check([_tool("ip"), "netns", "exec", lone, _tool("nft"), "-f", str(tmp_path / ruleset)])
    squatter = Listener(lone, "nobody", port)
    try:
        for as_user, host in ((False, "127.0.0.1"), (True, "127.0.0.1"), (False, "::1")):
            answer = _send_key(lone, port, as_user, host)
            assert answer.startswith("unreachable"), answer
    finally:
        received = squatter.stop()
    assert received == b"", f"the squatter received {received[:200]!r}"
    rightful = Listener(lone, owner, port)
    try:
        assert _send_key(lone, port, as_user=False).startswith("answered")
    finally:
        assert THE_KEY.encode() in rightful.stop()
