"""Tune: change the live schedule fields of a running job (with a confirmation) and see the history, which
refreshes by itself and stays readable once the job has finished."""

import streamlit as st

from miles_control.client import ApiError
from miles_dashboard.charts import metric_charts, metrics_frame
from miles_dashboard.common import ACTIVE, RETRY_S, api, choose_job, rows, status_text

LIVE = ("update_weights_interval", "max_staleness", "pause_mode", "buffer_groups", "push_between_batches")
# fields a schedule type takes but that change nothing there, with the reason shown beside them
INERT = {("sync", "pause_mode"): "a sync job generates nothing while weights are pushed: no request is ever paused"}

client = api()
st.title("Tune a running job")
any_active = client.jobs(status=list(ACTIVE), limit=1).total > 0
finished_too = st.toggle("Finished jobs too (their history)", value=not any_active, key="tune_finished")
picked = choose_job(client, only_active=not finished_too)
if picked is None:
    st.stop()
job = client.job(picked.id)
changes = client.schedule_changes(job.id)
live = [k for k in LIVE if k in job.spec["schedule"]]  # the stored spec holds exactly its schedule type's fields
current = {k: job.spec["schedule"].get(k) for k in live}
for change in changes:  # what the job runs with now: its spec plus the changes it applied
    if change.status == "applied":
        current.update(change.patch)
st.markdown(f"#{job.id} {job.name} · {status_text(job.status)} · `{job.schedule}`")
if flash := st.session_state.pop("tune_flash", None):
    st.success(flash)
inert = {k: why for (kind, k), why in INERT.items() if kind == job.schedule and k in live}

if job.status not in ACTIVE:
    st.info(f"This job has {job.status}: its schedule can no longer change. Its history is below.")
else:
    st.caption(
        f"Changes apply at the job's next step boundary and are recorded. A {job.schedule} schedule takes changes "
        f"of {', '.join(f'`{k}`' for k in live)}."
    )
    with st.form("schedule"):
        a, b = st.columns(2)
        wanted = {}
        if "update_weights_interval" in live:
            wanted["update_weights_interval"] = a.number_input(
                "update_weights_interval", min_value=1, value=int(current["update_weights_interval"])
            )
        if "max_staleness" in live:
            wanted["max_staleness"] = b.number_input("max_staleness", min_value=0, value=int(current["max_staleness"]))
        modes = client.choices("SchedulePatch", "pause_mode")
        wanted["pause_mode"] = a.selectbox(
            "pause_mode",
            modes,
            index=modes.index(current["pause_mode"]),
            disabled="pause_mode" in inert,
            help=inert.get("pause_mode"),
        )
        if "buffer_groups" in live:
            buffer = b.number_input(
                "buffer_groups (0 = two steps' worth)", min_value=0, value=int(current["buffer_groups"] or 0)
            )
            if buffer:
                wanted["buffer_groups"] = buffer
        if "push_between_batches" in live:
            wanted["push_between_batches"] = a.checkbox(
                "push_between_batches",
                value=bool(current["push_between_batches"]),
                help="A push waits for the batch being generated to end and loads with nothing in flight.",
            )
        for field, why in inert.items():
            st.caption(f"`{field}` is disabled: {why}.")
        reviewed = st.form_submit_button("Review change")
    if reviewed:
        patch = {k: v for k, v in wanted.items() if v != current[k] and k not in inert}
        st.session_state["pending_patch"] = (job.id, patch)
    pending = st.session_state.get("pending_patch")
    if pending and pending[0] == job.id:
        patch = pending[1]
        if not patch:
            st.info("Nothing differs from what the job runs with.")
        else:
            st.warning("Apply " + ", ".join(f"**{k}**: {current[k]} → {v}" for k, v in patch.items()) + "?")
            ok, cancel = st.columns(8)[:2]
            if ok.button("Confirm", type="primary", key="confirm"):
                st.session_state.pop("pending_patch", None)  # the confirmation clears once submitted
                try:
                    change = client.patch_schedule(job.id, patch)
                except ApiError as exc:
                    st.session_state["tune_error"] = exc.message
                else:
                    st.session_state["tune_flash"] = f"Change {change.id} queued: it applies at the job's next step."
                st.rerun()
            if cancel.button("Cancel", key="cancel_change"):
                st.session_state.pop("pending_patch", None)
                st.rerun()
    if error := st.session_state.pop("tune_error", None):
        st.error(error)


@st.fragment(run_every=RETRY_S if job.status in ACTIVE else None)
def history() -> None:
    """The changes and the curves they act on; refreshed while the job runs (a change applies at its next step)."""
    st.subheader("History")
    changes = client.schedule_changes(job.id)
    if not changes:
        st.info("No changes yet.")
        return
    for c in reversed(changes):
        patch = ", ".join(f"{k} = {v}" for k, v in c.patch.items())
        where = f"before step {c.applied_step}" if c.applied_step is not None else "at the next step"
        why = f" · {c.message}" if c.status == "rejected" else ""
        st.markdown(f"- change {c.id}: `{patch}` · **{c.status}** {where}{why}")
    points = metrics_frame(rows(client.metrics(job.id, ["rollout/reward_mean", "eval/accuracy", "step/wall_s"])))
    charts = metric_charts(points, sorted(points["name"].unique()), rows(changes))
    for first in range(0, len(charts), 2):  # two a row; stacked on a narrow screen
        for column, (_, chart) in zip(st.columns(2), charts[first : first + 2], strict=False):
            column.altair_chart(chart, width="stretch")
    if charts:
        st.caption("Dashed lines: the changes, at the step they applied.")


history()
