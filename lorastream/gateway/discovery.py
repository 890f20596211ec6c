"""Worker discovery: one ``--worker NAME:PORT`` may stand for several workers.

A name that resolves to several addresses (a Kubernetes headless Service: one A record per ready
pod) is one worker per address; the pool resolves it again periodically, so workers join and
leave as the records change. IPv4 addresses are preferred when a name has both families, so
``localhost`` (127.0.0.1 and ::1, one server) stays one worker. IP literals are taken as they are;
a name that does not resolve is kept as it is (gRPC's own resolver gets its chance, and the health
check decides).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[list[str]]]


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port)."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"worker {target!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def join_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def pick_addresses(addresses: Sequence[str], port: int) -> list[str]:
    """Targets for the resolved ``addresses`` of one name: IPv4 if any, else IPv6; deduplicated,
    sorted (a stable order keeps the log and the metrics labels quiet)."""
    v4 = {a for a in addresses if ipaddress.ip_address(a).version == 4}
    chosen = v4 or {a for a in addresses if ipaddress.ip_address(a).version == 6}
    return [join_target(a, port) for a in sorted(chosen, key=ipaddress.ip_address)]


async def resolve_target(target: str) -> list[str]:
    """The worker targets ``target`` stands for now (raises OSError when the lookup fails)."""
    host, port = split_target(target)
    if is_ip_literal(host):
        return [join_target(host, port)]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise OSError(f"{host} has no addresses")
    return pick_addresses(addresses, port)


class TargetResolver:
    """Resolves the configured targets; remembers the last answer of each for failed lookups."""

    def __init__(self, targets: Sequence[str], resolve: Resolver | None = None) -> None:
        self._targets = list(targets)
        self._resolve = resolve
        self._last: dict[str, list[str]] = {}

    async def resolve(self) -> list[str]:
        resolve = self._resolve or resolve_target
        found: list[str] = []
        for target in self._targets:
            try:
                self._last[target] = await resolve(target)
            except (OSError, ValueError) as exc:
                log.warning("cannot resolve worker %s (%s); keeping %s", target, exc,
                            self._last.get(target, [target]))
            found += self._last.get(target, [target])
        return list(dict.fromkeys(found))

    def name_of(self, address: str) -> str | None:
        """The host name ``address`` was last resolved from (None: an address given as is): the
        name a worker's TLS certificate is checked against."""
        for target, addresses in self._last.items():
            host = split_target(target)[0]
            if address in addresses and not is_ip_literal(host):
                return host
        return None
