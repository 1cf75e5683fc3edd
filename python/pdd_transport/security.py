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

from dataclasses import dataclass
from pathlib import Path

from pdd_transport._native import SEALED_LANE_CRYPTO, TlsConfig, make_test_pki

__all__ = ["NONE", "SEALED_LANE_CRYPTO", "Security", "TestPki", "TlsConfig", "make_test_pki", "test_pki"]


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
