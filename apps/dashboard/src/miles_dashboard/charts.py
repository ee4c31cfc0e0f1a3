"""Data shaping and Altair charts of the dashboard: pure functions of what the API returns."""

from __future__ import annotations

import altair as alt
import pandas as pd

STAGES = ["rollout", "reward", "judge", "train", "weight_sync", "eval", "wait_rollout", "checkpoint", "restore"]
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
# A metric's unit by the end of its name (first match wins), else by a word in it; every chart's y axis names one.
UNITS = {
    "tokens_per_s": "tokens/s", "_per_s": "per s", "_ms": "ms", "_s": "s", "bytes": "bytes", "_mb": "MB",
    "_pct": "%", "accuracy": "fraction", "frac": "fraction", "_share": "fraction", "grad_norm": "L2 norm",
    "num_tokens": "tokens", "_tokens": "tokens", "_len": "tokens", "weight_version": "version",
}  # fmt: skip
UNIT_WORDS = {
    "kl": "nats", "entropy": "nats", "logprob": "nats", "mismatch_k3": "nats", "reward": "reward",
    "loss": "loss", "objective": "loss", "staleness": "versions", "ratio": "ratio", "tis": "weight",
    "advantage": "advantage", "value": "value", "weight": "weight", "groups": "groups", "count": "count",
}  # fmt: skip


def unit_of(name: str) -> str:
    """The unit a metric is measured in ("value" when its name says nothing more)."""
    for suffix, unit in UNITS.items():
        if name.endswith(suffix):
            return unit
    leaf = name.rsplit("/", 1)[-1]
    for word, unit in UNIT_WORDS.items():
        if word in leaf:
            return unit
    return "value"


def stage_scale() -> alt.Scale:
    return alt.Scale(domain=STAGES, range=STAGE_COLORS)


def metrics_frame(points: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(points, columns=["name", "step", "value", "wall_time"])
    return df.astype({"step": int, "value": float, "wall_time": float})


def smooth(df: pd.DataFrame, weight: float, by: list[str]) -> pd.DataFrame:
    """An exponential moving average of `value` along the step, per series (`by`), debiased as TensorBoard's
    smoothing is (the first points are not pulled towards 0); weight 0 leaves the values as they are."""
    if weight <= 0 or df.empty:
        return df
    parts = []
    for _, part in df.sort_values("step").groupby(by, sort=False):
        ema = part["value"].ewm(alpha=1 - weight, adjust=True).mean()
        parts.append(part.assign(value=ema.to_numpy()))
    return pd.concat(parts)


def with_axis(df: pd.DataFrame, axis: str) -> tuple[pd.DataFrame, str, str]:
    """The frame with the x column of `axis` ("step" or "wall time": seconds since its first point), the column
    and its title."""
    if axis == "step":
        return df, "step", "step"
    start = float(df["wall_time"].min()) if not df.empty else 0.0
    return df.assign(seconds=df["wall_time"] - start), "seconds", "wall time since the first point (s)"


def change_rules(changes: list[dict] | None, x: str = "step", at: dict[int, float] | None = None) -> list[alt.Chart]:
    """Schedule changes that applied, as dashed vertical rules labelled with what changed (on a wall-time axis,
    `at` maps a step to its x)."""
    applied = [c for c in changes or [] if c.get("applied_step") is not None]
    if at is not None:
        applied = [c for c in applied if c["applied_step"] in at]
    if not applied:
        return []
    rules = pd.DataFrame(
        [{x: c["applied_step"] if at is None else at[c["applied_step"]], "change": _change_label(c)} for c in applied]
    )
    base = alt.Chart(rules).encode(x=f"{x}:Q")
    return [
        base.mark_rule(color="#b279a2", strokeDash=[4, 3]).encode(tooltip=["change:N"]),
        base.mark_text(align="left", baseline="top", dx=3, dy=2, fontSize=10, color="#b279a2").encode(
            text="change:N", y=alt.value(0)
        ),
    ]


def with_segments(df: pd.DataFrame, breaks: list[float] | None) -> pd.DataFrame:
    """`segment`: which attempt of a resumed run each point belongs to (`breaks`: the attempts' start times), so
    that a curve is not drawn across the time the job was stopped."""
    if not breaks or df.empty:
        return df.assign(segment=0)
    return df.assign(segment=[sum(t >= b for b in breaks[1:]) for t in df["wall_time"]])


def metric_charts(
    df: pd.DataFrame,
    names: list[str],
    changes: list[dict] | None = None,
    axis: str = "step",
    log: bool = False,
    smoothing: float = 0.0,
    breaks: list[float] | None = None,
) -> list[tuple[str, alt.LayerChart]]:
    """One line chart per metric (`(name, chart)`), each as wide as its container, with its own x axis (numbers and
    title) and a y axis titled with the unit; against step or wall time; optional EMA smoothing (the raw points stay,
    faint) and log scale (values ≤ 0 left out); schedule changes as labelled dashed rules; a resumed run's attempts
    as separate segments (`breaks`). A click picks the step of the nearest point (selection `pick`)."""
    df = df[df["name"].isin(names)]
    if log:
        df = df[df["value"] > 0]
    if df.empty:
        return []
    df = with_segments(df, breaks)
    df, x, x_title = with_axis(df, axis)
    at = None if x == "step" else df.groupby("step")[x].min().to_dict()
    charts = []
    for name in [n for n in names if n in set(df["name"])]:
        part = df[df["name"] == name].assign(kind="raw")
        if smoothing > 0:
            part = pd.concat([part, smooth(part, smoothing, ["name", "segment"]).assign(kind="smoothed")])
        scale = alt.Scale(type="log") if log else alt.Scale(zero=False)
        tooltip = ["name:N", "step:Q", alt.Tooltip("value:Q", format=".4g"), "kind:N"]
        line = (
            alt.Chart()
            .mark_line(point=alt.OverlayMarkDef(size=18))
            .encode(
                x=alt.X(f"{x}:Q", title=x_title, axis=alt.Axis(format="~g", labelOverlap=True)),
                y=alt.Y("value:Q", title=unit_of(name), scale=scale, axis=alt.Axis(format="~g")),
                opacity=alt.condition(
                    alt.datum.kind == "raw", alt.value(0.3 if smoothing > 0 else 1.0), alt.value(1.0)
                ),
                detail=["kind:N", "segment:N"],
                tooltip=tooltip,
            )
        )
        # the points carry the click selection (Vega-Lite's nearest works on point marks, not on lines)
        points = (
            alt.Chart()
            .mark_circle(size=30, opacity=0)
            .encode(x=f"{x}:Q", y="value:Q", tooltip=tooltip)
            .add_params(alt.selection_point(name="pick", fields=["step"], on="click", nearest=True))
        )
        layers: list[alt.Chart] = [line, points, *change_rules(changes, x, at)]
        chart = alt.layer(*layers, data=part).properties(width="container", height=230, title=name)
        charts.append((name, chart))
    return charts


def _change_label(change: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in change["patch"].items()) + f" (step {change['applied_step']})"


def spans_frame(spans: list[dict], t0: float | None = None) -> pd.DataFrame:
    df = pd.DataFrame(spans, columns=["step", "stage", "worker", "start", "end", "num_tokens", "num_bytes"])
    if df.empty:
        return df.assign(start_s=[], end_s=[], duration_ms=[])
    t0 = float(df["start"].min()) if t0 is None else t0
    return df.assign(start_s=df["start"] - t0, end_s=df["end"] - t0, duration_ms=(df["end"] - df["start"]) * 1000)


def gantt(df: pd.DataFrame, boundaries: pd.DataFrame | None = None) -> alt.Chart:
    """Per-stage timeline: one row per worker, one bar per span, seconds since the first span shown; `boundaries`
    (columns `start_s`, `step`) draws where each step began as a labelled grey rule."""
    bars = (
        alt.Chart(df)
        .mark_bar(height=16)
        .encode(
            x=alt.X("start_s:Q", title="seconds since the first span shown"),
            x2="end_s:Q",
            y=alt.Y("worker:N", title=None),
            color=alt.Color("stage:N", scale=stage_scale(), legend=alt.Legend(orient="right", title="stage")),
            tooltip=["stage:N", "step:Q", "worker:N", alt.Tooltip("duration_ms:Q", format=",.1f", title="ms")],
        )
    )
    layers: list[alt.Chart] = [bars]
    if boundaries is not None and not boundaries.empty:
        base = alt.Chart(boundaries).encode(x="start_s:Q")
        layers += [
            base.mark_rule(color="#888", strokeDash=[2, 2]).encode(tooltip=["step:Q"]),
            base.mark_text(align="left", baseline="top", dx=2, fontSize=9, color="#888").encode(
                text=alt.Text("step:Q", format="d"), y=alt.value(0)
            ),
        ]
    return (
        alt.layer(*layers)
        .properties(width="container", height=60 * df["worker"].nunique() + 50)
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
    """Share of wall time per stage; with `by` (runs), one bar per run within each stage, coloured by run. Sized
    by its container."""
    tooltip = ["stage:N", alt.Tooltip("seconds:Q", format=",.2f"), alt.Tooltip("share:Q", format=".1%"), "kind:N"]
    encode = dict(
        x=alt.X("share:Q", title="share of wall time", axis=alt.Axis(format="%")),
        y=alt.Y("stage:N", title=None, sort="-x"),
        opacity=alt.condition(alt.datum.kind == "work", alt.value(1.0), alt.value(0.45)),
        tooltip=tooltip + ([f"{by}:N"] if by else []),
    )
    if by:
        encode.update(
            yOffset=alt.YOffset(f"{by}:N"),
            color=alt.Color(
                f"{by}:N", title=None, scale=alt.Scale(scheme="tableau10"), legend=alt.Legend(orient="top")
            ),
        )
        rows = per["stage"].nunique() * max(per[by].nunique(), 1)
        return alt.Chart(per).mark_bar().encode(**encode).properties(width="container", height=max(140, 18 * rows))
    encode["color"] = alt.Color("stage:N", scale=stage_scale(), legend=None)
    return alt.Chart(per).mark_bar().encode(**encode).properties(width="container", height=max(120, 32 * len(per)))


def series_chart(
    df: pd.DataFrame,
    x: str,
    x_title: str,
    y_title: str,
    color: str | None = None,
    changes: list[dict] | None = None,
    log: bool = False,
) -> alt.Chart:
    """A line chart of `value` against `x`, one colour per `color` group (runs get distinct colours), with
    schedule changes (on a step axis) as labelled rules."""
    encode = dict(
        x=alt.X(f"{x}:Q", title=x_title, axis=alt.Axis(format="~g")),
        y=alt.Y(
            "value:Q",
            title=y_title if unit_of(y_title) == "value" or "(" in y_title else f"{y_title} ({unit_of(y_title)})",
            scale=alt.Scale(type="log") if log else alt.Scale(zero=False),
            axis=alt.Axis(format="~g"),
        ),
        tooltip=[f"{x}:Q", alt.Tooltip("value:Q", format=".4g")] + ([f"{color}:N"] if color else []),
    )
    if color:
        encode["color"] = alt.Color(
            f"{color}:N", title=None, scale=alt.Scale(scheme="tableau10"), legend=alt.Legend(orient="right")
        )
    if "segment" in df.columns:
        encode["detail"] = "segment:N"  # a resumed run: no line across the time it was stopped
    line = alt.Chart(df).mark_line(point=alt.OverlayMarkDef(size=15)).encode(**encode)
    rules = change_rules(changes, x) if x == "step" else []
    return alt.layer(line, *rules).properties(width="container", height=300).interactive()


def logprob_strip(logprobs: list[float]) -> alt.Chart:
    """A response's per-token logprobs as a heat strip: one cell per token (token k spans [k, k+1)), darker where
    the token was less likely."""
    df = pd.DataFrame({"token": range(len(logprobs)), "logprob": logprobs})
    df = df.assign(end=df["token"] + 1)
    return (
        alt.Chart(df)
        .mark_rect()
        .encode(
            x=alt.X("token:Q", title="response token", axis=alt.Axis(format="d", tickMinStep=1)),
            x2="end:Q",
            color=alt.Color("logprob:Q", scale=alt.Scale(scheme="viridis"), title="logprob (nats)"),
            tooltip=["token:Q", alt.Tooltip("logprob:Q", format=".3f")],
        )
        .properties(width="container", height=50)
    )
