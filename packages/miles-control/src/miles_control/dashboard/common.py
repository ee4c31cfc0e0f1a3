"""What every page shares: the API connection (settings or a login form), job selection, formatting."""

from __future__ import annotations

import os
from datetime import datetime, timezone

import streamlit as st
from pydantic import BaseModel

from miles_control.api.schemas import JobPublic
from miles_control.client import ApiError, MilesClient

ACTIVE = ("queued", "starting", "running")
STATUS_COLORS = {
    "queued": "gray", "starting": "blue", "running": "blue",
    "succeeded": "green", "failed": "red", "cancelled": "orange",
}  # fmt: skip


def api() -> MilesClient:
    """The API client of this browser session: the API at MILES_API_URL (or the form's), with the token the
    visitor signed in with. The dashboard process holds no token of its own: every visitor signs in with theirs,
    and a token is never sent back to a browser (the field starts empty)."""
    state = st.session_state
    state.setdefault("api_url", os.environ.get("MILES_API_URL", "http://127.0.0.1:8420"))
    state.setdefault("token", "")
    with st.sidebar.expander("Connection", expanded=not state.token):
        url = st.text_input("API URL", value=state.api_url, key="api_url_input")
        token = st.text_input("Token", value="", type="password", key="token_input", placeholder="miles_…")
        if st.button("Connect", key="connect"):
            state.api_url, state.token = url.strip(), token.strip()
            st.rerun()
    if not state.token:
        st.info("Sign in with your token in the sidebar (create one with `miles tokens create --name me`).")
        st.stop()
    client = MilesClient(state.api_url, state.token, timeout=15.0)
    try:
        client.jobs(limit=1)
    except ApiError as exc:
        st.error(f"Cannot use the Miles API at {state.api_url}: {exc.message}")
        st.stop()
    return client


def status_text(status: str) -> str:
    return f":{STATUS_COLORS.get(status, 'gray')}[**{status}**]"


def rows(models: list[BaseModel]) -> list[dict]:
    """API models as plain rows, for tables and charts."""
    return [m.model_dump(mode="json") for m in models]


def age(moment: datetime) -> str:
    moment = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)  # the store writes UTC
    seconds = (datetime.now(timezone.utc) - moment).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(seconds, 0):.0f} s ago"


def choose_job(
    client: MilesClient, label: str = "Job", only_active: bool = False, show_status: bool = True
) -> JobPublic | None:
    """A job picker; remembers the choice across pages (and reads ?job= from the URL)."""
    page = client.jobs(status=list(ACTIVE) if only_active else None, limit=200)
    jobs = page.items
    if not jobs:
        st.info("No active jobs." if only_active else "No jobs yet: launch one on the Jobs page.")
        return None
    wanted = st.query_params.get("job") or st.session_state.get("job_id")
    ids = [j.id for j in jobs]
    index = ids.index(int(wanted)) if wanted and str(wanted).isdigit() and int(wanted) in ids else 0
    chosen = st.selectbox(
        label,
        jobs,
        index=index,
        format_func=lambda j: f"#{j.id} {j.name}" + (f" ({j.status})" if show_status else ""),
        key=f"pick-{label}",
    )
    st.session_state["job_id"] = chosen.id
    return chosen
