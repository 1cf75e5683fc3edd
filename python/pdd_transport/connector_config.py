"""A connector's transport settings (:class:`Settings`), read from its engine's config
mapping by the same ``pdd_*`` keys in every engine, and what makes its ends (a
:class:`~pdd_transport.transfers.Pusher`, a :class:`~pdd_transport.transfers.Puller`).
The deployment secret comes from a file or an environment variable, never the config
itself; TLS from PEM files. An error names the key and never quotes a value that could
be the secret. ``pdd_transport.transfers`` re-exports :class:`Settings`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdd_transport import _native
from pdd_transport.errors import InvalidArgument, PddError
from pdd_transport.local import LOCAL_SCHEME
from pdd_transport.security import AllowedDestinations, TlsConfig, split_address

if TYPE_CHECKING:
    from pdd_transport.layout import KvLayout
    from pdd_transport.transfers import Puller, Push, Pusher

__all__ = ["LOOPBACK_DESTINATIONS", "Settings", "config_error", "list_option", "path_option", "secret_from"]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def config_error(message: str) -> InvalidArgument:
    """A config error: `InvalidArgument` with the reason `invalid_argument`."""
    return InvalidArgument(message, "invalid_argument")


def _read_secret_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except OSError as e:
        raise config_error(f"pdd_secret_file: cannot read {path}: {e.strerror}") from None
    data = data.rstrip(b"\r\n")  # a file written by echo or an editor ends with a newline
    if not data:
        raise config_error(f"pdd_secret_file: {path} is empty (an empty secret authenticates nobody)")
    return data


def secret_from(extra: Mapping[str, Any]) -> bytes | None:
    """The deployment secret, from the file or the environment variable the config
    names; never from the config itself (it is logged, and every client of the engine's
    config sees it). Error messages never quote a value that could be the secret."""
    for literal in ("pdd_secret", "pdd_shared_secret"):
        if extra.get(literal) is not None:
            raise config_error(f"{literal}: the secret itself must not be in the connector's config (it is logged "
                                "and readable by whoever reads the config); put it in a file and name it with "
                                "pdd_secret_file, or in an environment variable named by pdd_secret_env")
    secret_file, secret_env = extra.get("pdd_secret_file"), extra.get("pdd_secret_env")
    if secret_file is not None and secret_env is not None:
        raise config_error("pdd_secret_file and pdd_secret_env both given: name one source of the secret")
    if secret_file is not None:
        if not isinstance(secret_file, str) or not secret_file or "\n" in secret_file:
            raise config_error("pdd_secret_file must be the path of a file holding the secret")
        return _read_secret_file(secret_file)
    if secret_env is not None:
        if not isinstance(secret_env, str) or not _ENV_NAME.fullmatch(secret_env):
            raise config_error("pdd_secret_env must name an environment variable (letters, digits, '_'); "
                                "the value given is not such a name (is it the secret itself? then move it to "
                                "the environment or a file)")
        text = os.environ.get(secret_env)
        if not text:
            raise config_error(f"pdd_secret_env names {secret_env}, which is not set (or empty) in this "
                                "engine's environment")
        return text.encode()
    text = os.environ.get("PDD_SECRET")  # the default variable: optional
    return text.encode() if text else None


def path_option(extra: Mapping[str, Any], name: str) -> str | None:
    value = extra.get(f"pdd_{name}")
    if value is None:
        return None
    if not isinstance(value, str) or not value or "-----BEGIN" in value or "\n" in value:
        raise config_error(f"pdd_{name} must be the path of a PEM file (the config holds no key or certificate "
                            "text)")
    if not os.path.isfile(value):
        raise config_error(f"pdd_{name}: no file at {value}")
    return value


def list_option(extra: Mapping[str, Any], name: str) -> list[str] | None:
    value = extra.get(f"pdd_{name}")
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise config_error(f"pdd_{name}={value!r}: expected a string or a list of strings")
    return [str(v) for v in value]


#: Where a prefill side may send KV when the config names no allow list: one-host
#: deployments and tests (every loopback address, either path).
LOOPBACK_DESTINATIONS = ("127.0.0.0/8", "::1/128", f"{LOCAL_SCHEME}127.0.0.0/8", f"{LOCAL_SCHEME}::1/128")

@dataclass
class Settings:
    """A connector's transport settings, read from its engine's config mapping by the
    same ``pdd_*`` names in every engine (vLLM's ``kv_connector_extra_config``;
    docs/vllm.md lists them). The secret is never in the mapping itself: the mapping
    names the file holding it (``pdd_secret_file``) or the environment variable
    (``pdd_secret_env``; without either, ``PDD_SECRET`` if set). TLS is three PEM files
    (``pdd_tls_cert``, ``pdd_tls_key``, ``pdd_tls_ca``), all or none.
    ``allowed_decoders``: where the prefill side may send KV
    (:class:`~pdd_transport.security.AllowedDestinations` entries), besides the
    ``connect`` addresses; None: loopback only (:data:`LOOPBACK_DESTINATIONS`)."""

    listen: str = "127.0.0.1:0"
    node_id: int | None = None
    lanes: int = 2
    secret: bytes | None = field(default=None, repr=False)  # never printed
    insecure: bool = False
    deadline_s: float = 30.0
    grant_timeout_s: float = 10.0
    dead_after_s: float = 5.0
    heartbeat_s: float = 1.0
    connect: list[str] = field(default_factory=list)
    allow_debug: bool = False
    idle_wait_s: float = 0.02
    #: The model's name in the KV layout's digest (both sides must agree); None: the
    #: engine's own name for it (vLLM: its served model name).
    model_id: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    #: The name a decoder's certificate must prove (P); None: each destination's host.
    tls_server_name: str | None = None
    #: The names a connecting prefill side's certificate may prove (D); empty: any the CA signed.
    tls_allowed_peers: list[str] = field(default_factory=list)
    allowed_decoders: list[str] | None = None
    #: The decode side's path: ``"wan"`` (a :class:`~pdd_transport.kv.KvReceiver`, for a
    #: MainDecode across the WAN) or ``"local"`` (a
    #: :class:`~pdd_transport.local.LocalReceiver`, for a RelayDecode next to prefill).
    path: str = "wan"
    #: KV compression on the WAN data lanes (``pdd_compress``): ``"auto"`` (compress
    #: where the sender's measurements say it pays), ``"on"`` or ``"off"``.
    compress: str = "auto"
    #: Transfer resume on the WAN path (``pdd_resume_window_s``): how long a session
    #: whose connections dropped keeps its transfers for a resume, both sides; None
    #: (the key set to 0): not offered.
    resume_window_s: float | None = 10.0

    @classmethod
    def from_config(cls, extra: Mapping[str, Any]) -> Settings:
        """Parse ``extra``; a value of the wrong kind raises :class:`InvalidArgument`
        naming the key."""
        def get(name: str, kind: Callable[[Any], Any], default: Any) -> Any:
            value = extra.get(f"pdd_{name}")
            if value is None:
                return default
            try:
                return kind(value)
            except (TypeError, ValueError) as e:
                raise InvalidArgument(f"pdd_{name}={value!r}: {e}", "invalid_argument") from None

        connect = extra.get("pdd_connect") or []
        if isinstance(connect, str):
            connect = [connect]
        d = cls()
        path = get("path", str, d.path)
        if path not in ("wan", "local"):
            raise InvalidArgument(f"pdd_path={path!r}: expected 'wan' or 'local'", "invalid_argument")
        tls_files = {name: path_option(extra, name) for name in ("tls_cert", "tls_key", "tls_ca")}
        if any(tls_files.values()) and not all(tls_files.values()):
            missing = ", ".join(f"pdd_{n}" for n, v in tls_files.items() if not v)
            raise config_error(f"TLS needs pdd_tls_cert, pdd_tls_key and pdd_tls_ca together; missing {missing}")
        compress = get("compress", str, d.compress)
        if compress not in ("auto", "on", "off"):
            raise InvalidArgument(f"pdd_compress={compress!r}: expected 'auto', 'on' or 'off'", "invalid_argument")
        resume_window_s = get("resume_window_s", float, d.resume_window_s)
        if resume_window_s is not None and not (resume_window_s >= 0 and resume_window_s != float("inf")):
            raise InvalidArgument(f"pdd_resume_window_s={resume_window_s!r}: expected seconds >= 0 (0: off)",
                                  "invalid_argument")
        allowed = list_option(extra, "allowed_decoders")
        if allowed is not None:
            AllowedDestinations(allowed)  # a malformed entry fails here, naming itself
        return cls(
            path=path,
            compress=compress,
            resume_window_s=resume_window_s or None,
            listen=get("listen", str, d.listen),
            node_id=get("node_id", int, None),
            lanes=get("lanes", int, d.lanes),
            secret=secret_from(extra),
            tls_server_name=get("tls_server_name", str, None),
            tls_allowed_peers=list_option(extra, "tls_allowed_peers") or [],
            allowed_decoders=allowed,
            **tls_files,
            insecure=get("insecure", bool, d.insecure),
            deadline_s=get("deadline_s", float, d.deadline_s),
            grant_timeout_s=get("grant_timeout_s", float, d.grant_timeout_s),
            dead_after_s=get("dead_after_s", float, d.dead_after_s),
            heartbeat_s=get("heartbeat_s", float, d.heartbeat_s),
            connect=[str(a) for a in connect],
            allow_debug=get("allow_debug", bool, d.allow_debug),
            idle_wait_s=get("idle_wait_s", float, d.idle_wait_s),
            model_id=get("model_id", str, d.model_id),
        )

    def decode_side(self, pool: Any, *, layout: KvLayout | None = None) -> Puller:
        """A decode instance's end: a receiver over ``pool`` listening on ``listen``
        (a :class:`~pdd_transport.kv.KvReceiver` on the WAN path, a
        :class:`~pdd_transport.local.LocalReceiver` where ``path`` is ``"local"``), its
        address published as a prefill side names it (``host:port``, or
        ``local://host:port``; see :func:`publish_address`), and a :class:`Puller` that
        owns it. ``layout``: the pool's KV layout, exchanged with each prefill side that
        has one too, so that another layout is mapped or refused (docs/kv.md
        "Heterogeneous layouts")."""
        from pdd_transport.transfers import Puller, publish_address

        receiver: Any
        blob = layout.encode() if layout is not None else None
        if self.path == "local":
            from pdd_transport.local import LocalReceiver

            receiver = LocalReceiver(pool, self.listen, secret=self.secret, insecure=self.insecure,
                                     tls=self.receiver_tls(), heartbeat_s=self.heartbeat_s,
                                     dead_after_s=self.dead_after_s, layout=blob)
        else:
            receiver = _native.KvReceiver(pool, self.listen, secret=self.secret, insecure=self.insecure,
                                          tls=self.receiver_tls(), heartbeat_s=self.heartbeat_s,
                                          dead_after_s=self.dead_after_s, layout=blob,
                                          resume_window_s=self.resume_window_s)
        host, port = receiver.address
        publish_address(f"{LOCAL_SCHEME if self.path == 'local' else ''}{host}:{port}")
        return Puller(receiver, grant_timeout_s=self.grant_timeout_s, deadline_s=self.deadline_s, owns_receiver=True,
                      layout=layout)

    def prefill_side(self, pool: Any, on_send: Callable[[Push, str, int, int, int], None] | None = None, *,
                     layout: KvLayout | None = None) -> Pusher:
        """A prefill instance's end: a :class:`Pusher` over ``pool``, already
        connecting to each ``connect`` address (one that cannot be reached yet is
        retried by the first push to it). ``layout``: the pool's KV layout, announced
        to each decoder (:class:`Pusher`'s ``layout``)."""
        from pdd_transport.transfers import Pusher

        pusher = Pusher(pool, grant_timeout_s=self.grant_timeout_s, deadline_s=self.deadline_s,
                        wan_options=self.wan_options(), local_options=self.local_options(), on_send=on_send, layout=layout,
                        allowed=self.allowed_destinations(), tls_for=self.sender_tls if self.tls_cert else None)
        for address in self.connect:
            try:
                pusher.sender_for(address)
            except PddError:
                pass  # the first push to it tries again, and fails with the reason
        return pusher

    def allowed_destinations(self) -> AllowedDestinations:
        """Where the prefill side may send KV: ``allowed_decoders`` (or, without it,
        every loopback address) and the ``connect`` addresses."""
        base = self.allowed_decoders if self.allowed_decoders is not None else list(LOOPBACK_DESTINATIONS)
        return AllowedDestinations([*base, *self.connect])

    def receiver_tls(self) -> TlsConfig | None:
        """The decode side's TLS (its certificate; which prefill names may connect), or None."""
        if not (self.tls_cert and self.tls_key and self.tls_ca):
            return None
        # An acceptor proves its own certificate and checks the connector's against
        # allowed_peers; the server name is what connectors check, unused here.
        return TlsConfig(self.tls_cert, self.tls_key, self.tls_ca, server_name=self.tls_server_name or "pdd-decoder",
                         allowed_peers=self.tls_allowed_peers)

    def sender_tls(self, address: str) -> TlsConfig | None:
        """The prefill side's TLS toward ``address``: the decoder must prove
        ``tls_server_name``, or else the address's host (as HTTPS does)."""
        if not (self.tls_cert and self.tls_key and self.tls_ca):
            return None
        name = self.tls_server_name or split_address(address)[1]
        return TlsConfig(self.tls_cert, self.tls_key, self.tls_ca, server_name=name)

    def wan_options(self) -> dict[str, Any]:
        """What each WAN :class:`~pdd_transport.kv.KvSender` of a :class:`Pusher` gets."""
        return {"lanes": self.lanes, "node_id": self.node_id, "secret": self.secret,
                "heartbeat_s": self.heartbeat_s, "dead_after_s": self.dead_after_s, "compress": self.compress,
                "resume_window_s": self.resume_window_s}

    def local_options(self) -> dict[str, Any]:
        """What each :class:`~pdd_transport.local.LocalSender` of a :class:`Pusher` gets."""
        return {"node_id": self.node_id, "secret": self.secret, "heartbeat_s": self.heartbeat_s,
                "dead_after_s": self.dead_after_s}
