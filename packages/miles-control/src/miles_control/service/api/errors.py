"""The API's error answers: what each status means, how routes document them in the OpenAPI document, and
the one shape of a 422 (a list of {loc, msg, type}, as FastAPI's validation errors have)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException

from miles_control.service.api.schemas import ErrorDetail

ERRORS = {
    400: "The body is not UTF-8 JSON, or nests too deep",
    401: "No bearer token, or an invalid or revoked one",
    403: "The token is read-only; this needs an admin token",
    404: "No such job (or attempt log)",
    409: "The job is not in a state that allows this",
    413: "The body is over the server's limit",
    502: "The Ray cluster did not answer",
}


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give, for the OpenAPI document (every one has a `detail` string but 422)."""
    return {code: {"model": ErrorDetail, "description": ERRORS[code]} for code in codes}


JOB = documented(401, 404)  # every route under /jobs/{job_id}
CHANGE = documented(400, 401, 403, 404, 409, 413)  # routes that change a job


def unprocessable(loc: list[str], msg: str) -> HTTPException:
    """A 422 in the shape of every other 422 (FastAPI's validation errors): a list of {loc, msg, type}."""
    return HTTPException(422, [{"loc": loc, "msg": msg, "type": "value_error"}])
