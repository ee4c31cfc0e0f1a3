"""Bench reports kept with their runs: the markdown, the jobs it compares and the files (plots) it shows."""

from __future__ import annotations

from sqlalchemy import select

from miles_control.service.store.base import StoreBase
from miles_control.service.store.models import Report, ReportFile


class ReportTables(StoreBase):
    """The report and report-file tables."""

    def add_report(
        self, kind: str, title: str, markdown: str, job_ids: list[int], files: dict[str, bytes] | None = None
    ) -> int:
        """Store a bench report with the files its markdown shows (its plots); returns its id."""
        with self.session() as s, s.begin():
            report = Report(kind=kind, title=title, markdown=markdown, job_ids=list(job_ids))
            s.add(report)
            s.flush()
            s.add_all([ReportFile(report_id=report.id, name=n, data=d) for n, d in (files or {}).items()])
            return report.id

    def reports(self, kind: str | None = None) -> list[Report]:
        """Every report (of `kind`), newest first."""
        with self.session() as s:
            query = select(Report) if kind is None else select(Report).where(Report.kind == kind)
            return list(s.scalars(query.order_by(Report.id.desc())))

    def report(self, report_id: int) -> Report | None:
        """One report, or None."""
        with self.session() as s:
            return s.get(Report, report_id)

    def report_files(self, report_id: int) -> list[str]:
        """The names of a report's files, sorted."""
        with self.session() as s:
            query = select(ReportFile.name).where(ReportFile.report_id == report_id).order_by(ReportFile.name)
            return list(s.scalars(query))

    def report_file(self, report_id: int, name: str) -> bytes | None:
        """A report's file by name, or None."""
        with self.session() as s:
            query = select(ReportFile.data).where(ReportFile.report_id == report_id, ReportFile.name == name)
            return s.scalars(query).first()
