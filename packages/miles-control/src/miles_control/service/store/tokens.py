"""API tokens: random bearer secrets stored as SHA-256 hashes, with a read-only or an admin scope.

The tokens carry 256 bits of randomness, so a fast hash is enough: nothing to brute-force."""

from __future__ import annotations

import hashlib
import secrets
from typing import Literal

from sqlalchemy import select, update

from miles_control.service.store.models import ApiToken, utcnow
from miles_control.service.store.store import Store

Scope = Literal["read", "admin"]
SCOPES: tuple[str, ...] = ("read", "admin")
PREFIX = "miles_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(store: Store, name: str, scope: Scope) -> tuple[ApiToken, str]:
    """Returns the row and the token itself, which is not stored and cannot be shown again."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    if not name.strip():
        raise ValueError("a token needs a name (who or what uses it)")
    token = PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(name=name.strip(), scope=scope, token_hash=hash_token(token), prefix=token[: len(PREFIX) + 4])
    with store.session() as s, s.begin():
        s.add(row)
    return row, token


def list_tokens(store: Store, include_revoked: bool = False) -> list[ApiToken]:
    query = select(ApiToken).order_by(ApiToken.id)
    if not include_revoked:
        query = query.where(ApiToken.revoked_at.is_(None))
    with store.session() as s:
        return list(s.scalars(query))


def revoke_token(store: Store, token_id: int) -> None:
    with store.session() as s, s.begin():
        row = s.get(ApiToken, token_id)
        if row is None:
            raise KeyError(f"no token {token_id}")
        if row.revoked_at is None:
            row.revoked_at = utcnow()


def check_token(store: Store, token: str) -> ApiToken | None:
    """The live token row for this secret, or None (unknown or revoked)."""
    with store.session() as s:
        row = s.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(token)))
        if row is None or row.revoked_at is not None:
            return None
        return row


def touch_token(store: Store, token_id: int) -> None:
    with store.session() as s, s.begin():
        s.execute(update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=utcnow()))
