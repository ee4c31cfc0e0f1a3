"""Routes under /api/v1/reports: the bench reports stored with their runs (`miles bench ... --store`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import Response

from miles_control.service.api.auth import ReadToken
from miles_control.service.api.errors import documented
from miles_control.service.api.schemas import ReportDetail, ReportPublic
from miles_control.service.reports import KINDS
from miles_control.service.store import Store

router = APIRouter(prefix="/api/v1/reports", tags=["reports"], responses=documented(401))
ReportId = Annotated[int, Path(ge=1, le=2**31 - 1, description="The report's id.")]
FileName = Annotated[str, Path(max_length=255, pattern=r"^[A-Za-z0-9._-]+$", description="A file's name.")]
MEDIA = {".png": "image/png", ".svg": "image/svg+xml", ".csv": "text/csv", ".md": "text/markdown"}


def _store(request: Request) -> Store:
    return request.app.state.store


@router.get("", response_model=list[ReportPublic], summary="Bench reports, newest first")
def list_reports(
    request: Request, _: ReadToken, kind: Annotated[str | None, Query(pattern="^(" + "|".join(KINDS) + ")$")] = None
) -> list[ReportPublic]:
    return [ReportPublic.model_validate(r) for r in _store(request).reports(kind)]


@router.get("/{report_id}", response_model=ReportDetail, responses=documented(401, 404))
def get_report(report_id: ReportId, request: Request, _: ReadToken) -> ReportDetail:
    store = _store(request)
    report = store.report(report_id)
    if report is None:
        raise HTTPException(404, f"no report {report_id}")
    return ReportDetail(**ReportPublic.model_validate(report).model_dump(), markdown=report.markdown,
                        files=store.report_files(report_id))  # fmt: skip


@router.get(
    "/{report_id}/files/{name}",
    response_class=Response,
    responses={**documented(401, 404), 200: {"content": {"image/png": {}}, "description": "The file's bytes"}},
)
def get_report_file(report_id: ReportId, name: FileName, request: Request, _: ReadToken) -> Response:
    data = _store(request).report_file(report_id, name)
    if data is None:
        raise HTTPException(404, f"report {report_id} has no file {name!r}")
    suffix = name[name.rfind(".") :].lower() if "." in name else ""
    return Response(data, media_type=MEDIA.get(suffix, "application/octet-stream"))
