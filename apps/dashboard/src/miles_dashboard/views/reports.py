"""Reports: the bench reports stored with their runs (`miles bench schedules|precision|algorithms|weights`), as the
API serves them: the markdown with its plots, and links to the jobs each one ran."""

import re

import streamlit as st

from miles_control.client import ApiError
from miles_dashboard.common import RETRY_S, api, clock

client = api()
st.title("Bench reports")
IMAGE = re.compile(r"!\[([^\]]*)\]\(([A-Za-z0-9._-]+)\)")  # one of the report's files, anywhere in a line


@st.fragment(run_every=RETRY_S * 10)
def chooser() -> None:
    """The stored reports, newest first, filtered by bench."""
    kind = st.segmented_control(
        "Bench", ["schedules", "precision", "algorithms", "weights"], selection_mode="single", key="report_kind"
    )
    reports = client.reports(kind)
    if not reports:
        st.info(
            "No bench report in this store yet. `miles bench schedules CONFIG --store URL` (or precision, "
            "algorithms, weights) stores its report with its runs; this page lists those of the store the API reads."
        )
        st.session_state.pop("report_id", None)
        return
    labels = {r.id: f"#{r.id} {r.kind}: {r.title} ({clock(r.created_at)})" for r in reports}
    st.selectbox("Report", list(labels), format_func=labels.__getitem__, key="report_id")


def show(report_id: int) -> None:
    try:
        report = client.report(report_id)
    except ApiError as exc:
        st.info(exc.message)
        return
    if report.job_ids:
        links = ", ".join(f"[#{i}](job?job={i})" for i in report.job_ids)
        st.markdown(f"Its runs: {links} (each opens on the Job page).")
    chunk: list[str] = []
    for line in report.markdown.splitlines():
        shown = [m for m in IMAGE.finditer(line) if m.group(2) in report.files]
        if not shown:
            chunk.append(line)
            continue
        at = 0
        for match in shown:  # the text before an image, then the image itself (markdown cannot fetch it)
            chunk.append(line[at : match.start()])
            st.markdown("\n".join(chunk))
            chunk = []
            st.image(client.report_file(report.id, match.group(2)), caption=match.group(1))
            at = match.end()
        chunk.append(line[at:])
    st.markdown("\n".join(chunk))


chooser()
if (chosen := st.session_state.get("report_id")) is not None:
    show(chosen)
