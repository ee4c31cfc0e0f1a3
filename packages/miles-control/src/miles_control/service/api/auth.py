"""Bearer-token auth: every route but health and the docs needs a token; changes need the admin scope."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from miles_control.service.store.models import ApiToken
from miles_control.service.store.tokens import check_token, touch_token

_bearer = HTTPBearer(auto_error=False, description="A token from `miles tokens create`.")
_TOUCH_EVERY_S = 60.0


def _authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None) -> ApiToken:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
    store, state = request.app.state.store, request.app.state
    now = time.monotonic()
    cached = state.token_cache.get(credentials.credentials)
    if cached is not None and now - cached[1] < state.settings.token_cache_s:
        return cached[0]
    token = check_token(store, credentials.credentials)
    if token is None:
        state.token_cache.pop(credentials.credentials, None)
        raise HTTPException(401, "invalid or revoked token", headers={"WWW-Authenticate": "Bearer"})
    if state.settings.token_cache_s > 0:
        if len(state.token_cache) > 10_000:  # bounded: unknown secrets are never cached
            state.token_cache.clear()
        state.token_cache[credentials.credentials] = (token, now)
    touched = request.app.state.token_touched
    if time.time() - touched.get(token.id, 0.0) > _TOUCH_EVERY_S:  # last_used_at, without a write per request
        touched[token.id] = time.time()
        touch_token(store, token.id)
    return token


def read_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> ApiToken:
    return _authenticate(request, credentials)


def admin_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> ApiToken:
    token = _authenticate(request, credentials)
    if token.scope != "admin":
        raise HTTPException(403, f"token {token.name!r} is read-only; this needs an admin token")
    return token


ReadToken = Annotated[ApiToken, Depends(read_token)]
AdminToken = Annotated[ApiToken, Depends(admin_token)]
