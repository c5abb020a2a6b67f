"""What an address is, said once: which text is an IP address, which is IPv6, loopback or a wildcard, and
how a host joins its port. The spec and the fleet validate with these, resolve and render print with them."""

from __future__ import annotations

import ipaddress

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
