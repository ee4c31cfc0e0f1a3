"""Job: live metrics, the per-stage timeline, time breakdown, throughput, weight-update latency,
samples and events; refreshed every few seconds while the job runs."""

import pandas as pd
import streamlit as st
import yaml

from miles_control.client import ApiError
from miles_dashboard.charts import (
    KEY_METRICS,
    breakdown,
    breakdown_chart,
    gantt,
    logprob_strip,
    metric_charts,
    metrics_frame,
    series_chart,
    spans_frame,
)
from miles_dashboard.common import ACTIVE, RETRY_S, api, attempt_starts, choose_job, clock, rows, status_text, timing
from miles_dashboard.job_text import readable_log, stored_of

client = api()
st.title("Job")
picked = choose_job(client, show_status=False)  # the status is in the header, which refreshes
if picked is None:
    st.stop()
job_id = picked.id
refresh = st.sidebar.toggle("Auto refresh while active", value=True, key="auto_refresh")
drawn = client.job(job_id)  # what the page is drawn for: a change of status (or a new attempt) redraws it
# While the cancel dialog is open the page holds still: a refresh would redraw the page without it, and a click on
# "Cancel the job" in the moment of a refresh would be lost.
confirming = st.session_state.get("confirm_cancel") == job_id and drawn.status in ACTIVE and not drawn.cancel_requested
if not confirming:  # another job, or this one moved on: the question is no longer open
    st.session_state.pop("confirm_cancel", None)


def _state(job) -> tuple:
    return job.status, len(job.attempts), job.cancel_requested


@st.fragment(run_every=RETRY_S)
def follow() -> None:
    """Every few seconds, whatever the page shows: has the job moved on (another status, a new attempt, a cancel
    asked elsewhere)? Then the whole page follows it, its refresh included."""
    if _state(client.job(job_id)) != _state(drawn):
        st.rerun()


def _ask_to_cancel() -> None:
    st.session_state["confirm_cancel"] = job_id


def _stop_asking() -> None:
    st.session_state.pop("confirm_cancel", None)


@st.dialog("Cancel this job?", on_dismiss=_stop_asking)
def confirm_cancel(job) -> None:
    st.write(
        f"#{job.id} {job.name} stops at its next step boundary; a cancelled job can be resumed from its last checkpoint."
    )
    keep, stop = st.columns(2)
    if stop.button("Cancel the job", type="primary", key="cancel_confirmed", on_click=_stop_asking):
        _act(lambda: client.cancel(job.id), "cancel requested")
    if keep.button("Keep it running", key="cancel_kept", on_click=_stop_asking):
        st.rerun()


@st.fragment(run_every=3 if refresh and drawn.status in ACTIVE and not confirming else None)
def show() -> None:
    job = client.job(job_id)
    head, actions = st.columns([4, 1])
    head.markdown(
        f"### #{job.id} {job.name} · {status_text(job.status)} · `{job.schedule}` · "
        f"step {job.last_step or 0}/{job.num_steps}"
    )
    head.progress(min(1.0, (job.last_step or 0) / max(job.num_steps, 1)))
    head.caption(timing(job, client.steps(job_id)))
    if job.error:
        head.error(job.error)
    all_events = rows(client.events(job_id, limit=1000))
    tracked = [e["data"] for e in all_events if e["kind"] == "tracking" and e["data"].get("link")]
    if tracked:  # the job's experiment trackers: a URL is a link, a local folder or store is shown to copy
        head.markdown(
            "Tracked in "
            + " · ".join(
                f"[{t['type']}]({t['link']})" if t["link"].startswith("http") else f"{t['type']}: `{t['link']}`"
                for t in tracked
            )
        )
    if job.status in ACTIVE and not job.cancel_requested and actions.button("Cancel…", key="cancel"):
        _ask_to_cancel()
        st.rerun(scope="app")  # the page again, holding still while the dialog is open
    if confirming:
        confirm_cancel(job)
    if job.cancel_requested and job.status in ACTIVE:
        actions.caption("Cancel requested: stopping at the next step.")
    if job.resumable and actions.button("Resume", key="resume", type="primary"):
        _act(lambda: client.resume(job_id), "queued again")

    tabs = st.tabs(
        [
            "Metrics",
            "Timeline",
            "Time breakdown",
            "Throughput",
            "Weight sync",
            "Samples",
            "Events",
            "Logs",
            "Spec",
            "Resources",
        ]
    )
    points = metrics_frame(rows(client.metrics(job_id)))
    changes = rows(client.schedule_changes(job_id))
    with tabs[0]:
        names = sorted(points["name"].unique())
        default = [n for n in KEY_METRICS if n in names] or names[:6]
        # Keyed by the names on offer: when new metrics appear (a starting job), the defaults apply again.
        chosen = st.multiselect("Metrics", names, default=default, key=f"metrics-{job_id}-{len(names)}")
        shown = _chart_controls(points, job)
        charts = metric_charts(
            shown,
            chosen,
            changes,
            axis=st.session_state["chart_axis"],
            log=st.session_state["chart_log"],
            smoothing=st.session_state["chart_smoothing"],
            breaks=attempt_starts(job),
        )
        if not charts:
            st.info("Choose metrics above." if names else "No metrics yet (or none above 0 on a log scale).")
        else:
            step = None
            for first in range(0, len(charts), 2):  # two a row; Streamlit stacks the columns on a narrow screen
                for column, (name, chart) in zip(st.columns(2), charts[first : first + 2], strict=False):
                    with column:
                        event = st.altair_chart(
                            chart,
                            on_select="rerun",
                            selection_mode="pick",
                            key=f"grid-{job_id}-{name}",
                            width="stretch",
                        )
                    pick = ((event or {}).get("selection") or {}).get("pick") or []  # a state: a dict with attributes
                    if pick and step is None:
                        step = int(pick[0]["step"])
            if step is not None:  # a click on a point: that step's samples and timeline, under the charts
                _step_detail(job, step)
            else:
                st.caption("Click a point to see that step's samples and timeline.")
            st.caption(
                "Dashed lines: schedule changes, labelled, at the step they applied. A resumed run's attempts are "
                "drawn apart. The controls (and the step range) stay as set while the page refreshes."
            )
            picked = shown[shown["name"].isin(chosen)]
            st.download_button(
                "Download CSV",
                picked.to_csv(index=False),
                file_name=f"job-{job.id}-metrics.csv",
                mime="text/csv",
                key="metrics_csv",
            )
    with tabs[1]:
        _timeline(job, changes)
    spans = rows(client.spans(job_id))
    summary = client.summary(job_id).model_dump()  # the numbers `miles run` prints and the bench reports
    with tabs[2]:
        per, wall = breakdown(summary)
        if per.empty:
            st.info("No finished steps yet.")
        else:
            st.altair_chart(breakdown_chart(per), width="stretch")
            idle = per.loc[per["kind"] != "work", "seconds"].sum()
            work = per.loc[per["kind"] == "work", "seconds"].sum()
            note = " (stages overlapped: shares add up to more than 100 %)" if work > wall * 1.01 else ""
            st.markdown(
                f"Wall time **{wall:,.1f} s** (steps 1–{summary['num_steps']}); work {work:,.1f} s; "
                f"trainer idle {idle:,.1f} s{note}. Busy: rollout {summary['rollout_busy_s']:,.1f} s, trainer "
                f"{summary['trainer_busy_s']:,.1f} s; achieved / ideal overlap bound **{summary['ratio_to_ideal']:.2f}**."
            )
            st.dataframe(per.style.format({"seconds": "{:,.2f}", "share": "{:.1%}"}), hide_index=True)
    with tabs[3]:
        rates = points[points["name"].isin(["rollout/tokens_per_s", "train/tokens_per_s"])]
        if rates.empty:
            st.info("No throughput yet.")
        else:
            st.altair_chart(
                series_chart(rates, "step", "step", "tokens/s", color="name", changes=changes), width="stretch"
            )
    with tabs[4]:
        sync = [s for s in spans if s["stage"] == "weight_sync"]
        if not sync:
            st.info("No weight updates yet.")
        else:
            df = pd.DataFrame(
                {"step": [s["step"] for s in sync], "value": [(s["end"] - s["start"]) * 1000 for s in sync]}
            )
            st.altair_chart(
                series_chart(df, "step", "step", "weight update latency (ms)", changes=changes), width="stretch"
            )
            mean = summary["weight_sync_mean_s"]
            st.markdown(
                f"{len(df)} updates: mean **{df['value'].mean() if mean is None else mean * 1000:,.1f} ms**, "
                f"p50 {df['value'].median():,.1f} ms, max {df['value'].max():,.1f} ms; "
                f"{sync[-1]['num_bytes'] / 1e6:,.2f} MB via `{sync[-1]['attrs'].get('transport', '?')}`."
            )
    with tabs[5]:
        samples = rows(client.samples(job_id, limit=400))
        if not samples:
            st.info("No samples yet.")
        else:
            steps = sorted({s["step"] for s in samples}, reverse=True)
            # the latest step by default, and again when a newer one arrives
            step = st.selectbox("Step", steps, key=f"sample_step-{job_id}-{steps[0]}")
            of_step = [s for s in samples if s["step"] == step]
            st.caption(stored_of(job, len(of_step)))
            _samples(of_step, f"tab-{job_id}")
    with tabs[6]:
        events = sorted(all_events, key=lambda e: e["created_at"], reverse=True)
        for event in events:  # newest first, with readable times
            event["time"] = clock(event["created_at"])
        st.dataframe(
            pd.DataFrame(events, columns=["time", "kind", "step", "message"]),
            hide_index=True,
            width="stretch",
        )
    with tabs[7]:
        _logs(job)
    with tabs[8]:
        st.caption("The job's spec as launched (defaults filled in), as the API stores it.")
        st.code(yaml.safe_dump(job.spec, sort_keys=False), language="yaml")
    with tabs[9]:
        _resources(points, changes)


RESOURCES = {"cpu_pct": "CPU (% of one core)", "rss_mb": "resident memory (MB)", "gpu_mem_mb": "GPU memory (MB)"}


def _resources(points: pd.DataFrame, changes: list[dict]) -> None:
    """CPU, memory and GPU memory of each worker over the steps (`sys/<worker>/<measure>`, sampled by the
    workers themselves; the rollout worker's include its engines' processes)."""
    usage = points[points["name"].str.startswith("sys/")]
    if usage.empty:
        st.info("No resource samples (recorded from this version on, once per train step).")
        return
    parts = usage["name"].str.split("/", expand=True)
    usage = usage.assign(worker=parts[1], measure=parts[2])
    for measure, title in RESOURCES.items():
        part = usage[usage["measure"] == measure]
        if not part.empty:
            st.altair_chart(series_chart(part, "step", "step", title, color="worker", changes=changes), width="stretch")
    latest = usage[usage["step"] == usage["step"].max()].pivot_table(index="worker", columns="measure", values="value")
    st.dataframe(latest.round(1), width="stretch")
    st.caption(
        "Sampled by each worker at every train step: CPU averaged since the previous sample (100 % = one core), "
        "resident memory, and on GPU the peak memory torch allocated. The rollout worker counts its engine "
        "servers (its child processes)."
    )


def _step_detail(job, step: int) -> None:
    """One step: its samples and its per-stage timeline."""
    st.subheader(f"Step {step}")
    _samples(rows(client.samples(job.id, step=step)), f"step-{job.id}-{step}")
    df = spans_frame(rows(client.spans(job.id, step_min=step, step_max=step)))
    if df.empty:
        st.info(f"No spans of step {step}.")
    else:
        st.altair_chart(gantt(df), width="stretch")


def _samples(samples: list[dict], key: str) -> None:
    """A step's samples: a table filtered by reward (length in tokens, reward, status, text), then one sample's
    images (a vision-language model's prompt) beside its text, its per-token logprobs as a heat strip and a
    multi-turn episode's turns."""
    if not samples:
        st.info("No samples stored for this step.")
        return
    rewards = [s["reward"] for s in samples]
    low, high = min(rewards), max(rewards)
    if high > low:
        low, high = st.slider("Reward", low, high, (low, high), key=f"reward-{key}")
    shown = [s for s in samples if low <= s["reward"] <= high]
    columns = ["reward", "num_tokens", "status", "prompt", "response", "label", "weight_versions"]
    table = pd.DataFrame(shown, columns=columns).rename(columns={"num_tokens": "length (tokens)"})
    st.dataframe(table, hide_index=True, width="stretch")
    if not shown:
        return
    index = st.selectbox(
        "Sample",
        range(len(shown)),
        format_func=lambda i: f"{i + 1}: reward {shown[i]['reward']:.3g} · {shown[i]['prompt'][:60]!r}",
        key=f"sample-{key}",
    )
    sample = shown[index]
    if sample.get("images"):  # a vision-language model's prompt: its images beside the text
        left, right = st.columns([1, 2])
        left.image(sample["images"], caption=[f"image {i + 1}" for i in range(len(sample["images"]))])
        right.markdown(f"**prompt**: {sample['prompt']}\n\n**response**: {sample['response']}")
    if sample.get("logprobs"):
        st.altair_chart(logprob_strip(sample["logprobs"]), width="stretch")
        st.caption("The engine's logprob of each response token (darker: less likely); hover for the values.")
    else:
        st.caption("No per-token logprobs stored for this sample (stored from this version on).")
    for turn in sample.get("turns") or []:
        with st.chat_message("user" if turn["role"] in ("user", "tool") else "assistant"):
            st.markdown(f"**{turn['role']}**: {turn['content']}")


def _chart_controls(points: pd.DataFrame, job) -> pd.DataFrame:
    """The metric charts' controls (x axis, smoothing, log scale, step range), kept in the session so that a
    refresh keeps them; returns the points within the step range."""
    a, b, c = st.columns([1, 1, 1])
    a.radio("x axis", ["step", "wall time"], horizontal=True, key="chart_axis")
    b.slider("Smoothing (EMA)", 0.0, 0.95, 0.0, 0.05, key="chart_smoothing")
    c.toggle("Log scale", key="chart_log")
    last = int(points["step"].max()) if not points.empty else 0
    if last < 1:
        return points
    key, seen = f"chart_steps-{job.id}", st.session_state.get(f"chart_last-{job.id}")
    saved = st.session_state.get(key)
    if saved is not None and (saved[1] == seen or saved[1] > last):  # a range up to the latest step follows it
        st.session_state[key] = (min(saved[0], last), last)
    st.session_state[f"chart_last-{job.id}"] = last
    low, high = st.slider("Step range", 0, last, (0, last), key=key)
    return points[(points["step"] >= low) & (points["step"] <= high)]


def _logs(job) -> None:
    """An attempt's logs (the last attempt by default): the driver's, or one SGLang server's; the tail, which the
    page's refresh follows while the job runs."""
    numbers = [a.number for a in job.attempts]
    if not numbers:
        st.info("No attempt yet: the job has not started.")
        return
    left, middle, right = st.columns([1, 1, 1])
    attempt = left.selectbox("Attempt", numbers[::-1], key=f"log_attempt-{job.id}-{numbers[-1]}")
    try:
        sources = client.log_sources(job.id, attempt=attempt)
    except ApiError as exc:
        st.info(exc.message)
        return
    labels = {s.name: f"{s.name} ({s.description}, {s.size_bytes / 1024:.0f} KiB)" for s in sources}
    source = middle.selectbox("Log", list(labels), format_func=labels.get, key=f"log_source-{job.id}-{attempt}")
    kib = right.select_slider("Tail (KiB)", [16, 64, 256, 1024], value=64, key="log_tail")
    try:
        text = client.logs(job.id, attempt=attempt, tail_bytes=kib << 10, source=source or "driver")
    except ApiError as exc:
        st.info(exc.message)
        return
    described = {s.name: s.description for s in sources}  # the server says whose: "SGLang server 0, after restart 1"
    whose = "The driver's log" if source == "driver" else f"The log of {described.get(source, source)}"
    newest_first = st.toggle("Newest line first", value=True, key="log_newest_first")
    st.caption(
        f"{whose}, attempt {attempt} of {len(numbers)} (the last {kib} KiB"
        + ("; it follows the job while it runs)" if job.status in ACTIVE else ")")
    )
    st.code(readable_log(text, newest_first) or "(empty)", language="log")


def _act(call, done: str) -> None:
    """An action on the job, then the whole page again: it follows the job's new state at once."""
    try:
        call()
    except ApiError as exc:
        st.error(exc.message)
        return
    st.session_state["flash"] = done
    st.rerun()


def _timeline(job, changes: list[dict]) -> None:
    last = job.last_step or 0
    if last < 1:
        st.info("No steps yet.")
        return
    low, high = (1, last) if last == 1 else st.slider("Steps", 1, last, (max(1, last - 9), last), key="timeline_steps")
    df = spans_frame(rows(client.spans(job.id, step_min=low, step_max=high)))
    if df.empty:
        st.info("No spans in these steps.")
        return
    t0 = float(df["start"].min())
    began = [{"step": s.step, "start_s": s.started_at - t0} for s in client.steps(job.id) if low <= s.step <= high]
    st.altair_chart(gantt(df, pd.DataFrame(began, columns=["step", "start_s"])), width="stretch")
    st.caption("Grey dotted lines: where each step began (its number on top).")
    counts = df.groupby("stage").size().to_dict()
    st.markdown("Spans shown: " + ", ".join(f"**{stage}** {n}" for stage, n in sorted(counts.items())))
    applied = [c for c in changes if c["applied_step"] is not None and low <= c["applied_step"] <= high]
    for c in applied:
        st.markdown(f"Schedule change before step {c['applied_step']}: `{c['patch']}`")


if flash := st.session_state.pop("flash", None):
    st.toast(flash)
follow()
show()
