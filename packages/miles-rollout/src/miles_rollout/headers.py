"""Headers of `rollout.remote_reward` (standard library only: the control plane imports it without httpx).

A header value `${NAME}` stands for the environment variable NAME, read where the rollout runs, so that an API key
need not be written into a spec (which is stored and shown as written). `redact_headers` is what the API shows.
"""

from __future__ import annotations

import os
import re


class HeaderError(RuntimeError):
    """A header names an environment variable that is not set; the message names the header."""


HEADER_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")  # a header value read from the environment


def redact_headers(spec: dict) -> dict:
    """A job spec (as stored) with the literal values of `rollout.remote_reward.headers` replaced by `<redacted>`
    (references `${NAME}` are kept: they are not secrets)."""
    remote = (spec.get("rollout") or {}).get("remote_reward") or {}
    headers = remote.get("headers") or {}
    if not any(HEADER_REFERENCE.match(str(v)) is None for v in headers.values()):
        return spec
    safe = {k: v if HEADER_REFERENCE.match(str(v)) else "<redacted>" for k, v in headers.items()}
    return {**spec, "rollout": {**spec["rollout"], "remote_reward": {**remote, "headers": safe}}}


def resolve_headers(headers: dict[str, str]) -> dict[str, str]:
    """`rollout.remote_reward.headers` as sent: a value `${NAME}` replaced by the environment variable NAME."""
    resolved = {}
    for key, value in headers.items():
        match = HEADER_REFERENCE.match(value)
        if match is not None:
            name = match.group(1)
            if name not in os.environ:
                raise HeaderError(
                    f"rollout.remote_reward.headers.{key}: {value} names the environment variable {name}, which is not "
                    "set where the rollout runs"
                )
            value = os.environ[name]
        resolved[key] = value
    return resolved
