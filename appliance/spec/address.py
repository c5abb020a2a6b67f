"""What an address is, said once: which text is an IP address, a DNS name, IPv6, loopback or a wildcard, how a
host joins its port, and what an http(s) URL of the spec may hold. The spec and the fleet validate with these,
resolve and render print with them."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip_address(text: str) -> IPAddress | None:
    """`text` as an IP address; None for a name (localhost) or anything else. An IPv6 zone (fe80::1%eth0) is
    none: systemd's IPAddressAllow= and nft take none."""
    if "%" in text:
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def is_ipv6(text: str) -> bool:
    """An IPv6 address or network, the only kind with a colon: bracketed beside a port, `ip6` to nft."""
    return ":" in text


def is_loopback(host: str) -> bool:
    """Reached from this machine alone: localhost, or an address of 127.0.0.0/8 or ::1."""
    address = ip_address(host)
    return host == "localhost" or (address is not None and address.is_loopback)


def is_wildcard(host: str) -> bool:
    """Every address of this machine: 0.0.0.0 or ::."""
    address = ip_address(host)
    return address is not None and address.is_unspecified


def bracketed(host: str) -> str:
    """The host as a URL or a host:port writes it: an IPv6 address in brackets."""
    return f"[{host}]" if is_ipv6(host) else host


def host_port(host: str, port: int) -> str:
    return f"{bracketed(host)}:{port}"


def network_of(address: str) -> str:
    """One address as the network of it alone: 10.0.0.5/32, fd00::5/128."""
    return str(ipaddress.ip_network(address))


# RFC 1123 host names: letters, digits and inner hyphens, dot-separated; nothing an nft ruleset, a unit or a
# YAML file reads as syntax (urlsplit's hostname is whatever stands before the last colon, spaces and all).
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
DNS_NAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")
# scheme://host[:port][/path]: no user, query or fragment; the path in unreserved characters (RFC 3986) and /.
_URL = re.compile(r"^(https?)://(\[[0-9A-Fa-f:.]+\]|[^/\[\]:]+)(?::([0-9]{1,5}))?(/[A-Za-z0-9._~/-]*)?$")


def is_dns_name(text: str) -> bool:
    """A host name as DNS spells it, at most 253 characters; digits and dots alone are an address or nothing."""
    return len(text) <= 253 and DNS_NAME.fullmatch(text) is not None and not re.fullmatch(r"[0-9.]+", text)


@dataclass(frozen=True)
class Url:
    scheme: str
    host: str  # an IP address (IPv6 without its brackets) or a DNS name
    port: int | None
    path: str


def http_url(text: str) -> Url | None:
    """`text` as an http(s) URL whose every part is what it claims, or None."""
    m = _URL.fullmatch(text)
    if m is None:
        return None
    scheme, host, port, path = m.group(1), m.group(2), m.group(3), m.group(4) or ""
    if host.startswith("["):
        host = host[1:-1]
        if not is_ipv6(host) or ip_address(host) is None:
            return None
    elif ip_address(host) is None and not is_dns_name(host):
        return None
    if port is not None and not 1 <= int(port) <= 65535:
        return None
    return Url(scheme, host, int(port) if port is not None else None, path)
