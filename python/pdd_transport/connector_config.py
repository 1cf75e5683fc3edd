"""Reading a connector's ``pdd_*`` config keys that concern security: the deployment
secret (from a file or an environment variable, never the config itself), TLS files,
lists. Every engine's connector reads them the same way
(:meth:`pdd_transport.transfers.Settings.from_config`). An error names the key and
never quotes a value that could be the secret.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from pdd_transport.errors import InvalidArgument

__all__ = ["config_error", "list_option", "path_option", "secret_from"]

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
