"""Credentials out of what people and other processes see: logs, events, terminal output, API answers.

A store URL (`postgresql+psycopg://USER:PASSWORD@HOST/DB`), a Ray dashboard address or an MLflow tracking URI may
carry a password. Processes get such a URL through their environment, never their command line; everything that
shows one passes it through `mask_credentials` first."""

from __future__ import annotations

import logging
import re
from typing import Any

MASK = "***"  # what SQLAlchemy's render_as_string(hide_password=True) writes

# scheme://user:password@ — the password ends at the first "@", as SQLAlchemy's make_url reads it (so a store URL
# is masked exactly where the store finds its password), and at whitespace (a URL inside a longer message).
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@]*):(?P<password>[^\s@]*)@")
# libpq and many HTTP services also take a secret as a query parameter
_QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:password|passwd|pwd|sslpassword|secret|token|access_token|api_key|apikey)=)[^&\s#]*",
    re.IGNORECASE,
)


def mask_credentials(text: str) -> str:
    """`text` with the password of every URL in it replaced by `***` (the user, host and path stay readable)."""
    text = _USERINFO.sub(rf"\g<head>:{MASK}@", text)
    return _QUERY_SECRET.sub(rf"\g<head>{MASK}", text)


def masked(value: Any) -> Any:
    """`value` (an event's data: strings, lists, dicts) with `mask_credentials` applied to every string in it."""
    if isinstance(value, str):
        return mask_credentials(value)
    if isinstance(value, dict):
        return {key: masked(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(masked(item) for item in value)
    return value


class MaskingFormatter(logging.Formatter):
    """Wraps a handler's formatter: its lines (tracebacks included) carry no URL password, since an exception's
    message may quote a URL it was given."""

    def __init__(self, inner: logging.Formatter | None = None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return mask_credentials(self.inner.format(record))


def mask_log_handlers(logger: logging.Logger | None = None) -> None:
    """Mask the lines of every handler of `logger` (the root logger by default), keeping each one's format."""
    for handler in (logger or logging.getLogger()).handlers:
        if not isinstance(handler.formatter, MaskingFormatter):
            handler.setFormatter(MaskingFormatter(handler.formatter))
