"""Compare: runs of the same workload side by side (e.g. sync vs fully_async): reward and accuracy
against wall time, time breakdown, a summary table, and the schedule bench report when one exists."""

import os
from pathlib import Path

import pandas as pd
import streamlit as st
from charts import breakdown, breakdown_chart, metrics_frame, series_chart
from common import ACTIVE, RETRY_S, api, rows

client = api()
st.title("Compare runs")
jobs = client.jobs(limit=200).items
if len(jobs) < 1:
    st.info("No jobs yet.")
    st.stop()
finished = [j for j in jobs if j.last_step]
chosen = st.multiselect(
    "Jobs", jobs, default=finished[:2], format_func=lambda j: f"#{j.id} {j.name} ({j.schedule})", key="cmp"
)


@st.fragment(run_every=RETRY_S if any(j.status in ACTIVE for j in chosen) else None)
def comparison(chosen: list) -> None:
    """The chosen runs side by side; refreshed while one of them runs."""
    chosen = [client.job(j.id) for j in chosen]  # their progress now, not at the first draw
    curves, shares, table = [], [], []
    for job in chosen:
        label = f"#{job.id} {job.schedule}"
        points = metrics_frame(rows(client.metrics(job.id, ["rollout/reward_mean", "eval/accuracy"])))
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
                "status": job.status,
                "steps": summary["num_steps"],
                "wall s": round(wall, 1),
                "samples/s": round(summary["samples_per_s"], 2),
                "achieved / ideal": round(summary["ratio_to_ideal"], 2),
                "weight update ms (mean)": None if sync_mean is None else round(1000 * sync_mean, 1),
                "final accuracy": round(accuracy[-1][1], 3) if accuracy else None,
            }
        )
    st.dataframe(pd.DataFrame(table), hide_index=True, width="stretch")
    if curves:
        df = pd.concat(curves)
        for name, title in (("rollout/reward_mean", "reward (mean)"), ("eval/accuracy", "held-out accuracy")):
            part = df[df["name"] == name]
            if not part.empty:
                st.altair_chart(
                    series_chart(part, "seconds", "wall time since the first step (s)", title, color="run"),
                    width="stretch",
                )
    both = pd.concat(shares) if shares else pd.DataFrame()
    if not both.empty:
        st.subheader("Time breakdown")
        st.altair_chart(breakdown_chart(both, by="run"))


if chosen:
    comparison(chosen)

st.subheader("Schedule bench report")
folder = Path(
    st.text_input("Folder of `miles bench schedules --out`", os.environ.get("MILES_BENCH_DIR", "bench-schedules"))
)
report = folder / "report.md"
if report.exists():
    st.markdown(report.read_text())
    for image in sorted(folder.glob("*.png")):
        st.image(str(image), caption=image.name)
else:
    st.caption(f"No report at {report} (run `miles bench schedules CONFIG --out {folder}`).")
