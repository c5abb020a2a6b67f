"""Who listens on a TCP port of this machine (this network namespace), as the kernel says in /proc/net/tcp and
/proc/net/tcp6: the uid that owns each listening socket. Read before a key is sent to a local port, so a key is
never handed to another user's listener on a port the server left free while it restarts.
"""

from __future__ import annotations

from pathlib import Path

LISTEN = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp prints the state
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def listening_uids(port: int, tables: tuple[Path, ...] = TABLES) -> set[int]:
    """The owners of the sockets listening on `port` (any address); empty when none listens."""
    owners: set[int] = set()
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:  # no IPv6 in this kernel, or no /proc: nothing is known to listen
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
            if len(fields) > 7 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                owners.add(int(fields[7]))
    return owners
