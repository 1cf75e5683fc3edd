"""Security settings shared by every endpoint and role (``docs/security.md``).

Two mechanisms, usable together:

- ``secret``: a pre-shared root secret. Protocol v2 authenticates both ends of every
  lane by challenge-response over it (HMAC-SHA256 proofs over fresh nonces; the
  secret itself never travels), and binds every transfer to the session it was
  granted to, so a peer can neither fill another peer's grant nor take over its
  session. It does not encrypt.
- ``tls``: TLS 1.3 with mutual authentication (:class:`TlsConfig`: our certificate
  and key, the CA, the name the accepting peer must prove, the names connecting
  peers may prove). Encrypts and authenticates every byte; the per-block CRC32C is
  then negotiated off, since the AEAD already covers it.

A listener on a non-loopback address with neither refuses to start unless
``insecure=True`` says so explicitly.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pdd_transport._native import SEALED_LANE_CRYPTO, TlsConfig, make_test_pki
from pdd_transport.errors import InvalidArgument

__all__ = ["NONE", "SEALED_LANE_CRYPTO", "AllowedDestinations", "Security", "TestPki", "TlsConfig",
           "make_test_pki", "split_address", "test_pki"]

_LOCAL = "local://"
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Security:
    """How an endpoint authenticates its peers.

    ``secret``: the root secret both ends must prove they hold (bytes, the same on
    every P, RLD and MD of a deployment); ``None`` authenticates nobody by secret.
    ``tls``: TLS 1.3 with mutual authentication, or ``None``.
    ``insecure``: allow listening beyond loopback with neither.
    """

    secret: bytes | None = None
    tls: TlsConfig | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.secret is not None and not isinstance(self.secret, bytes):
            raise TypeError("Security.secret must be bytes or None")
        if self.secret is not None and len(self.secret) == 0:
            raise ValueError("an empty secret authenticates nobody: give None or some bytes")
        if self.tls is not None and not isinstance(self.tls, TlsConfig):
            raise TypeError("Security.tls must be a TlsConfig or None")

    def __repr__(self) -> str:  # never print the secret
        return "Security(secret=%s, tls=%r, insecure=%r)" % (
            "<set>" if self.secret else None, self.tls, self.insecure)


NONE = Security()
"""No authentication: loopback only (or ``insecure``)."""


def split_address(address: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a destination address: ``"host:port"`` (scheme
    ``""``, the WAN path), ``"local://host:port"`` (scheme ``"local://"``), an IPv6 host
    in brackets (``"[::1]:7100"``; returned without them). Anything else raises
    :class:`InvalidArgument`."""
    scheme = _LOCAL if address.startswith(_LOCAL) else ""
    rest = address[len(scheme):]
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{address!r} is not 'host:port' or 'local://host:port'", "invalid_argument")
    return scheme, host.lower(), int(port)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class AllowedDestinations:
    """The decode instances a prefill instance may send KV to: where a request's
    ``kv_transfer_params`` names a destination, P connects only if it is here, so a
    client that reaches P's API cannot make P connect anywhere else.

    Each entry is one of:

    - ``"host:port"``: exactly that host (a name or an IP literal, compared as written,
      case-insensitive) and port, on the WAN path;
    - ``"local://host:port"``: the same on the local path;
    - a network, ``"10.0.0.0/24"`` or ``"local://10.1.0.0/16"``: any port of any IP
      literal in it, on that path. Host names never match a network: resolving them
      here would let DNS decide where KV goes.

    ``AllowedDestinations(None)`` allows every destination (the library's default, for
    tests and single-host tools); an empty list allows none.
    """

    def __init__(self, entries: Iterable[str] | None) -> None:
        self.any = entries is None
        self._exact: set[tuple[str, str, int]] = set()
        self._networks: list[tuple[str, _Network]] = []
        for entry in entries or ():
            if not isinstance(entry, str) or not entry.strip():
                raise InvalidArgument(f"allowed destination {entry!r}: expected 'host:port', "
                                      "'local://host:port' or a network like '10.0.0.0/24'", "invalid_argument")
            entry = entry.strip()
            if "/" in entry[len(_LOCAL) if entry.startswith(_LOCAL) else 0:]:
                scheme = _LOCAL if entry.startswith(_LOCAL) else ""
                try:
                    network = ipaddress.ip_network(entry[len(scheme):], strict=False)
                except ValueError as e:
                    raise InvalidArgument(f"allowed destination {entry!r}: {e}", "invalid_argument") from None
                self._networks.append((scheme, network))
            else:
                scheme, host, port = split_address(entry)
                ip = _ip(host)
                self._exact.add((scheme, str(ip) if ip is not None else host, port))

    def allows(self, address: str) -> bool:
        """Whether ``address`` (a destination as a request names it) is allowed. A
        malformed address is not."""
        if self.any:
            return True
        try:
            scheme, host, port = split_address(address)
        except InvalidArgument:
            return False
        ip = _ip(host)
        if (scheme, str(ip) if ip is not None else host, port) in self._exact:
            return True
        return ip is not None and any(s == scheme and ip in net for s, net in self._networks)

    def __repr__(self) -> str:
        if self.any:
            return "AllowedDestinations(any)"
        listed = sorted(f"{s}{h}:{p}" for s, h, p in self._exact) + [f"{s}{n}" for s, n in self._networks]
        return f"AllowedDestinations({listed!r})"


@dataclass(frozen=True)
class TestPki:
    """A throwaway CA and per-name certificates on disk (tests, benches, demos)."""

    ca: Path
    certs: dict[str, tuple[Path, Path]]

    def tls(self, name: str, *, server_name: str, allowed_peers: list[str] | None = None) -> TlsConfig:
        """The :class:`TlsConfig` of the certificate made for ``name``."""
        cert, key = self.certs[name]
        return TlsConfig(cert, key, self.ca, server_name=server_name, allowed_peers=allowed_peers or [])


def test_pki(directory: str | Path, names: list[str]) -> TestPki:
    """Make a test CA and a certificate per name in ``directory`` (see
    :func:`make_test_pki`); never for production."""
    made = make_test_pki(Path(directory), names)
    ca = Path(made.pop("ca"))
    return TestPki(ca=ca, certs={n: (Path(c), Path(k)) for n, (c, k) in made.items()})


# pytest would otherwise try to collect these as test classes/functions when a test
# module imports them.
TestPki.__test__ = False  # type: ignore[attr-defined]
test_pki.__test__ = False  # type: ignore[attr-defined]
