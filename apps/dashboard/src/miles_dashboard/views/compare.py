"""Compare: runs of the same workload side by side (e.g. sync vs fully_async): a summary table with utilisation
beside throughput, the config diff of the runs (with a warning when they differ in more than the schedule), any
metric against wall time or step, time breakdown, and the schedule bench report when one exists."""

import pandas as pd
import streamlit as st

from miles_dashboard.charts import breakdown, breakdown_chart, metrics_frame, series_chart
from miles_dashboard.common import ACTIVE, RETRY_S, api, rows
from miles_dashboard.specs import beyond_schedule, spec_diff

client = api()
st.title("Compare runs")
jobs = client.jobs(limit=200).items
if len(jobs) < 1:
    st.info("No jobs yet.")
    st.stop()
finished = [j for j in jobs if j.last_step]
by_id = {j.id: j for j in jobs}  # ids: a refresh keeps the choice
ids = st.multiselect(
    "Jobs",
    list(by_id),
    default=[j.id for j in finished[:2]],
    format_func=lambda i: f"#{i} {by_id[i].name} ({by_id[i].schedule})",
    key="cmp",
)
chosen = [by_id[i] for i in ids]


names = sorted({n for j in chosen for n in client.metric_names(j.id)})
left, right = st.columns([3, 1])
# The choice outlives a change of runs: what was picked and is still on offer stays picked.
wanted = st.session_state.get("cmp_metrics_wanted", ["rollout/reward_mean", "eval/accuracy"])
picked = left.multiselect(
    "Metrics", names, default=[n for n in wanted if n in names], key=f"cmp_metrics-{'-'.join(map(str, ids))}"
)
st.session_state["cmp_metrics_wanted"] = picked
axis = right.radio("Against", ["wall time", "step"], horizontal=True, key="cmp_axis")


@st.fragment(run_every=RETRY_S if any(j.status in ACTIVE for j in chosen) else None)
def comparison(chosen: list, picked: list[str], axis: str) -> None:
    """The chosen runs side by side; refreshed while one of them runs."""
    chosen = [client.job(j.id) for j in chosen]  # their progress now, not at the first draw
    curves, shares, table = [], [], []
    for job in chosen:
        label = f"#{job.id} {job.name}"
        points = metrics_frame(rows(client.metrics(job.id, picked))) if picked else pd.DataFrame()
        steps = client.steps(job.id)
        start = min((s.started_at for s in steps), default=None)
        if start is not None and not points.empty:
            curves.append(points.assign(run=label, seconds=points["wall_time"] - start))
        summary = client.summary(job.id).model_dump()  # the numbers `miles run` prints and the bench reports
        per, wall = breakdown(summary)
        shares.append(per.assign(run=label))
        sync_mean = summary["weight_sync_mean_s"]
        accuracy = summary["eval_accuracy"]
        table.append(
            {
                "run": label,
                "schedule": job.schedule,
                "status": job.status,
                "steps": summary["num_steps"],
                "wall s": round(wall, 1),
                "samples/s": round(summary["samples_per_s"], 2),
                "train % of wall": round(100 * _share(per, "train"), 1),
                "rollout % of wall": round(100 * _share(per, "rollout"), 1),
                "achieved / ideal": round(summary["ratio_to_ideal"], 2),
                "weight update ms (mean)": None if sync_mean is None else round(1000 * sync_mean, 1),
                "final accuracy": round(accuracy[-1][1], 3) if accuracy else None,
            }
        )
    st.dataframe(pd.DataFrame(table), hide_index=True, width="stretch")
    if len(chosen) > 1:
        diff = spec_diff({f"#{j.id} {j.name}": j.spec for j in chosen})
        st.subheader("Config diff")
        if beyond := beyond_schedule(diff):
            st.warning(
                f"These runs differ in more than the schedule ({', '.join(beyond[:6])}"
                + (f" and {len(beyond) - 6} more" if len(beyond) > 6 else "")
                + "): a difference in speed or learning is not the schedule's alone."
            )
        if diff:
            st.dataframe(pd.DataFrame(diff), hide_index=True, width="stretch")
        else:
            st.caption("Their specs are the same (names and output folders aside).")
    if curves:
        df = pd.concat(curves)
        x, x_title = ("seconds", "wall time since the first step (s)") if axis == "wall time" else ("step", "step")
        for name in picked:
            part = df[df["name"] == name]
            if not part.empty:
                st.altair_chart(series_chart(part, x, x_title, name, color="run"), width="stretch")
    both = pd.concat(shares) if shares else pd.DataFrame()
    if not both.empty:
        st.subheader("Time breakdown")
        st.altair_chart(breakdown_chart(both, by="run"), width="stretch")


def _share(per: pd.DataFrame, stage: str) -> float:
    """Utilisation: a stage's time (summed over its workers) as a share of the loop's wall time."""
    return float(per.loc[per["stage"] == stage, "share"].sum()) if not per.empty else 0.0


if chosen:
    comparison(chosen, picked, axis)

st.subheader("Schedule bench report")
stored = client.reports("schedules")
if stored:
    latest = stored[0]
    st.markdown(
        f"The latest of this store: **#{latest.id} {latest.title}**; it and the others are on the Reports page."
    )
    st.page_link("views/reports.py", label="Open the Reports page", icon=":material/description:")
else:
    st.caption("No `miles bench schedules` report in this store yet (`--store URL` stores it where the API reads).")
