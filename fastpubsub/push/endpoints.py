"""Where push requests may go: https endpoints on public addresses, unless the operator says otherwise.

An endpoint is checked when a subscription is created or changed (the API
answers 422) and again each time the push-worker opens a connection: the name
is resolved then, the address checked, and the connection made to that very
address (TLS still verifies the name), so a name that resolved to a public
address at creation and to a private one later (DNS rebinding) gets nowhere.

Refused: anything that is not a global unicast address, that is loopback,
private (10/8, 172.16/12, 192.168/16, fc00::/7), link-local (169.254/16 with
the cloud metadata address 169.254.169.254, fe80::/10), shared (100.64/10),
multicast, reserved or unspecified. An IPv6 address that carries an IPv4
address (mapped, NAT64, IPv4-compatible, SIIT, 6to4, Teredo) is judged by it as
well, and local-use NAT64 (64:ff9b:1::/48) and site-local (fec0::/10) addresses
are refused.
FASTPUBSUB_PUSH_ALLOWED_HOSTS names exceptions: host names (any address they
resolve to is then accepted), addresses and CIDRs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastpubsub.exceptions import InvalidInputError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

RESOLVE_TIMEOUT_SECONDS = 5.0
# A host name: dot-separated labels of letters, digits, hyphens and underscores, 63 characters at most each.
_HOST_NAME = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?"
)


class EndpointRefusedError(InvalidInputError):
    """The push endpoint is not allowed: not https, or not a public address."""


# IPv6 addresses whose last 32 bits are an IPv4 address that a translator or
# the host itself may reach: NAT64 (64:ff9b::/96), the deprecated
# IPv4-compatible addresses (::/96) and SIIT's translated ones (::ffff:0:0:0/96).
_IPV4_IN_LAST_32_BITS = tuple(
    ipaddress.IPv6Network(network) for network in ("64:ff9b::/96", "::/96", "::ffff:0:0:0/96")
)
# Not global, though Python's is_global says they are: NAT64 for local use
# (RFC 8215) and the deprecated site-local addresses.
_NOT_GLOBAL_IPV6 = tuple(ipaddress.IPv6Network(network) for network in ("64:ff9b:1::/48", "fec0::/10"))


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address leads to besides a mapped one (NAT64, compatible, 6to4, Teredo)."""
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        return list(address.teredo)  # the relay and the client's outside address
    if any(address in network for network in _IPV4_IN_LAST_32_BITS):
        return [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    return []


def is_public(address: IPAddress) -> bool:
    """Whether `address` is a global unicast address; one carrying an IPv4 address is judged by it too."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return is_public(address.ipv4_mapped)
        if any(address in network for network in _NOT_GLOBAL_IPV6):
            return False
        if not all(is_public(inner) for inner in _embedded_ipv4(address)):
            return False
    return address.is_global and not address.is_multicast


@dataclass(frozen=True)
class EndpointPolicy:
    """The schemes and addresses push endpoints may use."""

    allow_http: bool = False
    allowed_names: frozenset[str] = frozenset()
    allowed_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def from_settings(cls, allow_http: bool, allowed_hosts: str) -> EndpointPolicy:
        """From FASTPUBSUB_PUSH_ALLOW_HTTP and FASTPUBSUB_PUSH_ALLOWED_HOSTS (see allowed_hosts_of)."""
        names, networks = allowed_hosts_of(allowed_hosts)
        return cls(allow_http, names, networks)

    def address_allowed(self, address: IPAddress) -> bool:
        return is_public(address) or any(address in network for network in self.allowed_networks)

    def target(self, url: str) -> tuple[str, int]:
        """The host and port of an endpoint URL, checked for everything but its addresses."""
        try:
            parts = urlsplit(url)
        except ValueError as exc:  # a bracketed host that is no IPv6 address, say
            raise EndpointRefusedError(f"the push endpoint is not a valid URL: {exc}") from None
        schemes = ("https", "http") if self.allow_http else ("https",)
        if parts.scheme.lower() not in schemes:
            raise EndpointRefusedError(
                "push endpoints must be https:// URLs (http:// only with FASTPUBSUB_PUSH_ALLOW_HTTP=true)"
            )
        try:
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise EndpointRefusedError(f"the push endpoint is not a valid URL: {exc}") from None
        if not host:
            raise EndpointRefusedError("the push endpoint names no host")
        if parts.username is not None or parts.password is not None:
            raise EndpointRefusedError("the push endpoint may not carry credentials: put them in headers")
        return host, port or (443 if parts.scheme.lower() == "https" else 80)

    async def check(self, url: str) -> None:
        """Refuse an endpoint (EndpointRefusedError: 422) unless every address it names is allowed."""
        host, port = self.target(url)
        await self.addresses(host, port)

    async def addresses(self, host: str, port: int) -> list[IPAddress]:
        """The addresses `host` may be reached at (resolved now); EndpointRefusedError if one is refused.

        A name in the allowed list may resolve to anything; an address literal
        is not resolved. One refused address refuses the host: a client cannot
        choose which of the answers it gets.
        """
        try:
            literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            literal = None
        found = [literal] if literal is not None else await _resolve(host, port)
        if literal is None and _name(host) in self.allowed_names:
            return found
        for address in found:
            if not self.address_allowed(address):
                raise EndpointRefusedError(
                    f"push endpoint host {host} is (or resolves to) {address}, which is not a public "
                    "address (loopback, private, link-local, metadata or reserved); "
                    "FASTPUBSUB_PUSH_ALLOWED_HOSTS may name it"
                )
        return found


def allowed_hosts_of(text: str) -> tuple[frozenset[str], tuple[IPNetwork, ...]]:
    """The host names and networks of FASTPUBSUB_PUSH_ALLOWED_HOSTS (comma-separated).

    ValueError names an entry that is neither an address, a CIDR network nor a
    host name (`10.0.0.0/33`, a URL): taken for a name, it would match no host.
    """
    names: set[str] = set()
    networks: list[IPNetwork] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
        except ValueError:
            if not _HOST_NAME.fullmatch(entry):
                raise ValueError(
                    f"{entry!r} is not a host name, an address or a CIDR network (such as 10.0.0.0/8)"
                ) from None
            names.add(_name(entry))
    return frozenset(names), tuple(networks)


def _name(host: str) -> str:
    return host.strip().lower().rstrip(".")


async def _resolve(host: str, port: int) -> list[IPAddress]:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_SECONDS):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError) as exc:
        raise EndpointRefusedError(f"push endpoint host {host} does not resolve: {exc}") from None
    except UnicodeError:  # an empty label (a..b), or one longer than 63 characters
        raise EndpointRefusedError(f"push endpoint host {host} is not a valid host name") from None
    return _unique(ipaddress.ip_address(info[4][0]) for info in infos)


def _unique(addresses: Iterable[IPAddress]) -> list[IPAddress]:
    return list(dict.fromkeys(addresses))
