"""The API key: a dependency on every route but /health (and the docs), compared in constant time."""
from __future__ import annotations

import hmac

from fastapi import Depends
from fastapi.params import Depends as DependsParam
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import ServeHTTPError

bearer = HTTPBearer(auto_error=False, description="the server's API key (--api-key / SICL_FAST_API_KEY)")


def key_dependencies(api_key: str | None) -> list[DependsParam]:
    """The dependencies of a guarded router: none without a key (so the docs show no lock), else the key check."""
    if api_key is None:
        return []
    want = api_key.encode()

    async def check_key(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), want):
            raise ServeHTTPError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 {"WWW-Authenticate": "Bearer"})

    return [Depends(check_key)]
