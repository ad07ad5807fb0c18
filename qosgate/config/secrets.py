"""Secrets the policy names but never holds: tokens, the front gateway's
secret, Redis passwords.

A policy names an environment variable; the secret is its value or, when the
variable is unset, the contents of the file named by `<VARIABLE>_FILE` (the
convention of container secrets mounted as files). Nothing here prints a
secret, and `redact_url` takes the password out of a URL before it is shown.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

FILE_SUFFIX = "_FILE"
_MAX_SECRET_BYTES = 64 * 1024


class SecretError(ValueError):
    """A secret's file is named but cannot be read."""


def read_secret(variable: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The secret `variable` names, from the environment or the file in
    `<variable>_FILE`; None when neither is set (or the variable is None).
    A file's one trailing newline is not part of the secret."""
    if not variable:
        return None
    value = environ.get(variable)
    if value:
        return value
    path = environ.get(variable + FILE_SUFFIX)
    if not path:
        return None
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_SECRET_BYTES + 1)
    except OSError as exc:
        # The path is the operator's, not secret; the contents never appear.
        raise SecretError(f"{variable}{FILE_SUFFIX}: cannot read {path}: {exc.strerror}") from None
    if len(data) > _MAX_SECRET_BYTES:
        raise SecretError(f"{variable}{FILE_SUFFIX}: {path} is over {_MAX_SECRET_BYTES} bytes")
    text = data.decode("utf-8", "surrogateescape").removesuffix("\n").removesuffix("\r")
    return text or None


def redis_url(url: str, url_env: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The Redis URL to connect to: the secret `url_env` names when it is
    set (a URL with its password, kept out of the policy), else `url`."""
    if url_env is None:
        return url
    value = read_secret(url_env, environ)
    if value is None:
        raise SecretError(
            f"{url_env}: unset (and no {url_env}{FILE_SUFFIX}), but it is to hold the Redis URL"
        )
    return value


def redis_password(password_env: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The Redis password `password_env` names (None where the policy names
    none). A variable named but unset is an error, not an empty password: the
    process would otherwise connect without AUTH, fail every call with NOAUTH
    and run on local limits in silence."""
    if password_env is None:
        return None
    value = read_secret(password_env, environ)
    if value is None:
        raise SecretError(f"{password_env}: unset (and no {password_env}{FILE_SUFFIX}), "
                          "but it is to hold the Redis password")
    return value


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, for display."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable URL>"
    if password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
