"""What every page shares: the API connection (settings or a login form), job selection, formatting."""

from __future__ import annotations

import os
from datetime import datetime, timezone

import streamlit as st
from pydantic import BaseModel

from miles_control.client import ApiError, MilesClient
from miles_control.service.api.schemas import JobPublic

ACTIVE = ("queued", "starting", "running")
STATUS_COLORS = {
    "queued": "gray", "starting": "blue", "running": "blue",
    "succeeded": "green", "failed": "red", "cancelled": "orange",
}  # fmt: skip


READS = frozenset(
    {"health", "jobs", "job", "metrics", "metric_names", "spans", "steps", "samples", "events", "summary",
     "schedule_changes", "presets", "choices", "reports", "report", "report_file"}
)  # fmt: skip
RETRY_S = 3  # how often a page checks the API while it is away, and how often live pages refresh


class RememberingClient:
    """The API client, with memory: a read (`READS`) that cannot reach the API answers what the same call
    answered last, and marks the session disconnected (the page then shows a banner and keeps its data instead
    of an error). An answer with a status (401, 404, 422, ...) is raised as it is; so is a read never made before."""

    def __init__(self, client: MilesClient, memory: dict) -> None:
        self._client, self._memory = client, memory

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if name not in READS:
            return attr

        def read(*args, **kwargs):
            key = (name, repr(args), repr(sorted(kwargs.items())))
            try:
                value = attr(*args, **kwargs)
            except ApiError as exc:
                if exc.status is not None or key not in self._memory:
                    raise
                st.session_state["disconnected"] = exc.message
                return self._memory[key]
            self._memory[key] = value
            return value

        return read


def _reachable(client: MilesClient) -> str | None:
    """None when the API answers (any status), else why not."""
    try:
        client.jobs(limit=1)
    except ApiError as exc:
        return exc.message if exc.status is None else None
    return None


@st.fragment(run_every=RETRY_S)
def _watch_connection(client: MilesClient) -> None:
    """Every few seconds: has the API come back (or gone away) since the page was drawn? Then draw it again."""
    away = _reachable(client)
    if bool(away) != bool(st.session_state.get("disconnected")):
        st.session_state["disconnected"] = away
        st.rerun()


def api() -> RememberingClient:
    """The API client of this browser session: the API at MILES_API_URL (or the form's), with the token the
    visitor signed in with. The dashboard process holds no token of its own: every visitor signs in with theirs,
    and a token is never sent back to a browser (the field starts empty). When the API cannot be reached the page
    keeps the data it last showed under a "disconnected — retrying" banner and reconnects by itself."""
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
    memory = state.setdefault("answers", {})
    if state.get("answers_of") != (state.api_url, state.token):  # another API or visitor: forget the old answers
        memory.clear()
        state.answers_of = (state.api_url, state.token)
    try:
        client.jobs(limit=1)
        state.disconnected = None
    except ApiError as exc:
        if exc.status is not None:
            st.error(f"Cannot use the Miles API at {state.api_url}: {exc.message}")
            st.stop()
        state.disconnected = exc.message
    _watch_connection(client)
    if state.disconnected:
        st.warning(
            f"**Disconnected — retrying** every {RETRY_S} s: {state.disconnected}. "
            + ("The data below is what the API last answered." if memory else "Nothing has been loaded yet."),
            icon=":material/cloud_off:",
        )
        if not memory:
            st.stop()
    return RememberingClient(client, memory)


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


def clock(moment: datetime | str) -> str:
    """A stored time (UTC) as the dashboard's local wall time, to the second."""
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    moment = moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def timing(job, steps: list) -> str:
    """Started, how long it ran (or has run), and while it runs the ETA from its last ten steps' pace."""
    if job.started_at is None:
        return f"Created {clock(job.created_at)}; not started yet."
    start = job.started_at if job.started_at.tzinfo else job.started_at.replace(tzinfo=timezone.utc)
    end = job.finished_at or datetime.now(timezone.utc)
    end = end if end.tzinfo else end.replace(tzinfo=timezone.utc)
    text = f"Started {clock(start)} · ran {duration((end - start).total_seconds())}"
    recent = sorted(steps, key=lambda s: s.step)[-10:]
    remaining = job.num_steps - (job.last_step or 0)
    if job.status in ACTIVE and len(recent) >= 2 and remaining > 0:
        pace = (recent[-1].ended_at - recent[0].ended_at) / (len(recent) - 1)
        text += f" · ETA {duration(pace * remaining)} ({remaining} steps at {pace:.1f} s a step)"
    return text


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
