"""What every page shares: the API connection (a sign-in kept for the browser session in a cookie), the banner
of an unreachable API, job selection, formatting."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from urllib.parse import quote, unquote

import streamlit as st
import streamlit.components.v1 as components
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


COOKIE = "miles_session"  # the sign-in of this browser session: API URL and token (no expiry: gone with the session)


class RememberingClient:
    """The API client, with memory: a read (`READS`) that cannot reach the API answers what the same call
    answered last, and marks the session disconnected (the page then shows a banner and keeps its data instead
    of an error). A read never made before stops the page under the same banner; an answer with a status (401, 404,
    422, ...) is raised as it is."""

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
                if exc.status is not None:
                    raise
                st.session_state["disconnected"] = exc.message
                if key not in self._memory:
                    away(exc.message, have_data=False)
                    st.stop()
                return self._memory[key]
            self._memory[key] = value
            return value

        return read


def away(reason: str, have_data: bool) -> None:
    """The one banner of an unreachable API, on every page."""
    st.warning(
        f"**Disconnected — retrying** every {RETRY_S} s: {reason}. "
        + ("The data below is what the API last answered." if have_data else "This page has nothing to show yet."),
        icon=":material/cloud_off:",
    )


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
    away_now = _reachable(client)
    if bool(away_now) != bool(st.session_state.get("disconnected")):
        st.session_state["disconnected"] = away_now
        st.rerun()


def _saved_sign_in() -> tuple[str, str] | None:
    """The API URL and token this browser session signed in with (the cookie `remember` wrote), if any."""
    raw = st.context.cookies.get(COOKIE)
    if not raw:
        return None
    try:
        saved = json.loads(unquote(raw))
        return str(saved["url"]), str(saved["token"])
    except (ValueError, KeyError, TypeError):
        return None


def _write_cookie(value: str | None) -> None:
    """Set (or, with None, clear) the session cookie from the page itself: a browser-session cookie for this
    dashboard's path, sent back only to it (SameSite=Strict); a reload, a new tab and a direct link then find the
    sign-in. The token never travels in a URL."""
    body = f"{COOKIE}={quote(value)}; path=/; SameSite=Strict" if value else f"{COOKIE}=; path=/; Max-Age=0"
    components.html(f"<script>window.parent.document.cookie = {json.dumps(body)};</script>", height=0)


def _sign_in_form(state) -> None:
    """The sign-in form, in the page itself (a collapsed sidebar hides nothing on a narrow screen)."""
    st.title("Sign in")
    st.info("Sign in with your token (create one with `miles tokens create --name me`).")
    if state.get("auth_error"):
        st.error(state.auth_error)
    with st.form("sign_in"):
        url = st.text_input("API URL", value=state.api_url, key="api_url_input")
        token = st.text_input("Token", value="", type="password", key="token_input", placeholder="miles_…")
        if st.form_submit_button("Connect", type="primary"):
            _connect(state, url.strip(), token.strip())
    st.stop()


def _connect(state, url: str, token: str) -> None:
    """Check the token against the API; keep it for the session (and the browser session's cookie) if it works."""
    if not token:
        state.auth_error = "Enter a token."
        st.rerun()
    try:
        MilesClient(url, token, timeout=15.0).jobs(limit=1)
    except ApiError as exc:
        if exc.status is not None:  # 401: a wrong token; unreachable: accepted, the banner says so
            state.auth_error = f"Cannot use the Miles API at {url}: {exc.message}"
            st.rerun()
    state.api_url, state.token, state.auth_error = url, token, None
    state.remember = json.dumps({"url": url, "token": token})
    st.rerun()


def sign_out() -> None:
    state = st.session_state
    state.token, state.remember, state.forget = "", None, True
    state.pop("answers", None)


def api() -> RememberingClient:
    """The API client of this browser session: the API at MILES_API_URL (or the form's), with the token the
    visitor signed in with, kept for the browser session in a cookie (a reload, a new tab or a direct link stays
    signed in; "Sign out" forgets it). The dashboard process holds no token of its own. When the API cannot be
    reached the page keeps the data it last showed under a "disconnected — retrying" banner and reconnects by
    itself; a page with nothing to show yet says so under the same banner."""
    state = st.session_state
    saved = _saved_sign_in() if not state.get("forget") else None
    state.setdefault("api_url", saved[0] if saved else os.environ.get("MILES_API_URL", "http://127.0.0.1:8420"))
    state.setdefault("token", saved[1] if saved else "")
    if state.get("forget"):
        _write_cookie(None)
    if not state.token:
        _sign_in_form(state)
    if state.get("remember"):
        _write_cookie(state.remember)
        state.remember, state.forget = None, False
    with st.sidebar.expander("Connection", expanded=False):
        st.caption(f"Signed in to {state.api_url}")
        if st.button("Sign out", key="sign_out"):
            sign_out()
            st.rerun()
    client = MilesClient(state.api_url, state.token, timeout=15.0)
    memory = state.setdefault("answers", {})
    if state.get("answers_of") != (state.api_url, state.token):  # another API or visitor: forget the old answers
        memory.clear()
        state.answers_of = (state.api_url, state.token)
    try:
        client.jobs(limit=1)
        state.disconnected = None
    except ApiError as exc:
        if exc.status == 401:  # revoked or wrong: back to the form, saying why
            state.auth_error = f"The API refused the token ({exc.message}); sign in again."
            sign_out()
            st.rerun()
        if exc.status is not None:
            st.error(f"Cannot use the Miles API at {state.api_url}: {exc.message}")
            st.stop()
        state.disconnected = exc.message
    _watch_connection(client)
    if state.disconnected:
        away(state.disconnected, have_data=bool(memory))
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


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)  # the store writes UTC


def run_seconds(job) -> float:
    """How long the job has run, over all its attempts (a resumed job ran before it was stopped too)."""
    now = datetime.now(timezone.utc)
    attempts = getattr(job, "attempts", None) or []
    if attempts:
        return sum((_utc(a.ended_at or now) - _utc(a.started_at)).total_seconds() for a in attempts)
    if job.started_at is None:
        return 0.0
    return (_utc(job.finished_at or now) - _utc(job.started_at)).total_seconds()


def timing(job, steps: list) -> str:
    """Started, how long it ran (or has run: every attempt counted), and while it runs the ETA from its last ten
    steps' pace."""
    if job.started_at is None:
        return f"Created {clock(job.created_at)}; not started yet."
    attempts = getattr(job, "attempts", None) or []
    first = _utc(min((a.started_at for a in attempts), default=job.started_at))
    text = f"Started {clock(first)} · ran {duration(run_seconds(job))}"
    if len(attempts) > 1:
        text += f" over {len(attempts)} attempts"
    recent = sorted(steps, key=lambda s: s.step)[-10:]
    remaining = job.num_steps - (job.last_step or 0)
    if job.status in ACTIVE and len(recent) >= 2 and remaining > 0:
        pace = (recent[-1].ended_at - recent[0].ended_at) / (len(recent) - 1)
        text += f" · ETA {duration(pace * remaining)} ({remaining} steps at {pace:.1f} s a step)"
    return text


def attempt_starts(job) -> list[float]:
    """Unix seconds at which each attempt began, in order: where a resumed run's curves break."""
    return sorted(_utc(a.started_at).timestamp() for a in getattr(job, "attempts", None) or [])


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
