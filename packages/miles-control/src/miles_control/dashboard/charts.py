"""Data shaping and Altair charts of the dashboard: pure functions of what the API returns."""

from __future__ import annotations

import altair as alt
import pandas as pd

STAGES = ["rollout", "reward", "train", "weight_sync", "eval", "wait_rollout", "checkpoint", "restore"]
STAGE_COLORS = ["#4c78a8", "#72b7b2", "#f58518", "#e45756", "#54a24b", "#bab0ac", "#b279a2", "#9d755d"]

# The curves a person looks at first, in this order (what exists of them is shown).
KEY_METRICS = [
    "rollout/reward_mean",
    "eval/accuracy",
    "train/loss",
    "train/kl",
    "train/entropy",
    "async/staleness_mean",
    "train/ratio",
    "train/tis",
    "train/logprob_diff",
    "train/logprob_diff_p99",
    "train/mismatch_k3",
]
UNITS = {"_s": "s", "tokens_per_s": "tokens/s", "bytes": "bytes", "accuracy": "fraction", "frac": "fraction"}


def unit_of(name: str) -> str:
    for suffix, unit in UNITS.items():
        if name.endswith(suffix):
            return unit
    return ""


def stage_scale() -> alt.Scale:
    return alt.Scale(domain=STAGES, range=STAGE_COLORS)


def metrics_frame(points: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(points, columns=["name", "step", "value", "wall_time"])
    return df.astype({"step": int, "value": float, "wall_time": float})


def metric_grid(df: pd.DataFrame, names: list[str], changes: list[dict] | None = None) -> alt.FacetChart | None:
    """One small line chart per metric (own y scale), against step; schedule changes as vertical rules."""
    df = df[df["name"].isin(names)]
    if df.empty:
        return None
    df = df.assign(label=[f"{n} ({unit_of(n)})" if unit_of(n) else n for n in df["name"]])
    line = (
        alt.Chart()
        .mark_line(point=alt.OverlayMarkDef(size=18))
        .encode(
            x=alt.X("step:Q", title="step"),
            y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False), axis=alt.Axis(format="~g")),
            tooltip=["name:N", "step:Q", alt.Tooltip("value:Q", format=".4g")],
        )
    )
    layers: list[alt.Chart] = [line]
    applied = [c for c in changes or [] if c.get("applied_step") is not None]
    if applied:
        rules = pd.DataFrame([{"step": c["applied_step"], "change": _change_label(c)} for c in applied])
        layers.append(
            alt.Chart(rules).mark_rule(color="#b279a2", strokeDash=[4, 3]).encode(x="step:Q", tooltip=["change:N"])
        )
    return (
        alt.layer(*layers, data=df)
        .properties(width=250, height=160)
        .facet(facet=alt.Facet("label:N", title=None), columns=3)
        .resolve_scale(y="independent")
    )


def _change_label(change: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in change["patch"].items()) + f" (step {change['applied_step']})"


def spans_frame(spans: list[dict], t0: float | None = None) -> pd.DataFrame:
    df = pd.DataFrame(spans, columns=["step", "stage", "worker", "start", "end", "num_tokens", "num_bytes"])
    if df.empty:
        return df.assign(start_s=[], end_s=[], duration_ms=[])
    t0 = float(df["start"].min()) if t0 is None else t0
    return df.assign(start_s=df["start"] - t0, end_s=df["end"] - t0, duration_ms=(df["end"] - df["start"]) * 1000)


def gantt(df: pd.DataFrame) -> alt.Chart:
    """Per-stage timeline: one row per worker, one bar per span, seconds since the first span shown."""
    return (
        alt.Chart(df)
        .mark_bar(height=16)
        .encode(
            x=alt.X("start_s:Q", title="seconds since the first span shown"),
            x2="end_s:Q",
            y=alt.Y("worker:N", title=None),
            color=alt.Color("stage:N", scale=stage_scale(), legend=alt.Legend(orient="right", title="stage")),
            tooltip=["stage:N", "step:Q", "worker:N", alt.Tooltip("duration_ms:Q", format=",.1f", title="ms")],
        )
        .properties(height=60 * df["worker"].nunique() + 40)
        .interactive(bind_y=False)
    )


def breakdown(summary: dict) -> tuple[pd.DataFrame, float]:
    """Seconds per stage and share of the loop's wall time, from the run's summary (`GET /jobs/{id}/summary`,
    the numbers `miles run` prints); idle stages (the trainer waiting for data) are marked as such."""
    stages = summary["stages"]
    if not stages:
        return pd.DataFrame(columns=["stage", "seconds", "share", "kind"]), 0.0
    per = pd.DataFrame(
        {
            "stage": [st["stage"] for st in stages],
            "seconds": [st["total_s"] for st in stages],
            "share": [st["share_of_wall"] for st in stages],
            "kind": ["idle (trainer waits)" if st["idle"] else "work" for st in stages],
        }
    )
    return per.sort_values("seconds", ascending=False).reset_index(drop=True), float(summary["wall_s"])


def breakdown_chart(per: pd.DataFrame, by: str | None = None) -> alt.Chart:
    encode = dict(
        x=alt.X("share:Q", title="share of wall time", axis=alt.Axis(format="%")),
        y=alt.Y("stage:N", title=None, sort="-x"),
        color=alt.Color("stage:N", scale=stage_scale(), legend=None),
        opacity=alt.condition(alt.datum.kind == "work", alt.value(1.0), alt.value(0.45)),
        tooltip=["stage:N", alt.Tooltip("seconds:Q", format=",.2f"), alt.Tooltip("share:Q", format=".1%"), "kind:N"],
    )
    chart = alt.Chart(per).mark_bar().encode(**encode)
    if by:
        return chart.properties(width=260, height=160).facet(column=alt.Column(f"{by}:N", title=None))
    return chart.properties(height=max(120, 32 * len(per)))


def series_chart(df: pd.DataFrame, x: str, x_title: str, y_title: str, color: str | None = None) -> alt.Chart:
    encode = dict(
        x=alt.X(f"{x}:Q", title=x_title),
        y=alt.Y("value:Q", title=y_title, scale=alt.Scale(zero=False)),
        tooltip=[f"{x}:Q", alt.Tooltip("value:Q", format=".4g")] + ([f"{color}:N"] if color else []),
    )
    if color:
        encode["color"] = alt.Color(f"{color}:N", title=None, legend=alt.Legend(orient="right"))
    return (
        alt.Chart(df).mark_line(point=alt.OverlayMarkDef(size=15)).encode(**encode).properties(height=280).interactive()
    )
