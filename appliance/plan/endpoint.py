"""Where something listens: a host and a port, and what follows from them for clients and sandboxes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import ConfigDict

from appliance.spec.address import host_port, ip_address, is_ipv6, is_loopback, is_wildcard, network_of

PRIVILEGED_PORTS = 1024  # below it binding needs CAP_NET_BIND_SERVICE (net.ipv4.ip_unprivileged_port_start)


@dataclass(frozen=True)
class Endpoint:
    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    host: str
    port: int

    @property
    def address(self) -> str:
        """host:port as a client dials it: a wildcard listener is reached on loopback."""
        return host_port("127.0.0.1" if is_wildcard(self.host) else self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def ipv6(self) -> bool:
        return is_ipv6(self.host)

    @property
    def loopback_only(self) -> bool:
        return is_loopback(self.host)

    @property
    def privileged(self) -> bool:
        """Its unit must grant CAP_NET_BIND_SERVICE, the one capability the service user ever gets."""
        return self.port < PRIVILEGED_PORTS

    @property
    def own_address(self) -> tuple[str, ...]:
        """The one non-loopback address of this machine it listens on, as a network (none for loopback or a
        wildcard): its probes and local clients dial it there, and come from it, past the units' IP filters."""
        if ip_address(self.host) is None or is_loopback(self.host) or is_wildcard(self.host):
            return ()  # localhost (prometheus.host is not checked to be an address)
        return (network_of(self.host),)
