"""Security settings shared by every endpoint and role.

Protocol v2 authenticates both ends of every lane by challenge-response over a
pre-shared ``secret`` (HMAC-SHA256 proofs over fresh nonces; the secret itself never
travels), and binds every transfer to the session it was granted to, so a peer can
neither fill another peer's grant nor take over its session. See
``docs/security.md`` for the threat model.

A listener on a non-loopback address without a secret refuses to start unless
``insecure=True`` says so explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Security:
    """How an endpoint authenticates its peers.

    ``secret``: the root secret both ends must prove they hold (bytes, the same on
    every P, RLD and MD of a deployment); ``None`` authenticates nobody.
    ``insecure``: allow listening beyond loopback without a secret.
    """

    secret: bytes | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.secret is not None and not isinstance(self.secret, bytes):
            raise TypeError("Security.secret must be bytes or None")
        if self.secret is not None and len(self.secret) == 0:
            raise ValueError("an empty secret authenticates nobody: give None or some bytes")

    def __repr__(self) -> str:  # never print the secret
        return "Security(secret=%s, insecure=%r)" % ("<set>" if self.secret else None, self.insecure)


NONE = Security()
"""No authentication: loopback only (or ``insecure``)."""
