"""Miles dashboard: launch jobs, watch their metrics and per-stage timing, tune schedules, compare runs.

Run with `miles dashboard` (or `streamlit run` on this file: it ships with miles-control as package data). It talks to the REST API only
(MILES_API_URL, MILES_TOKEN, or the sidebar's connection form) and imports nothing of Miles or torch."""

import streamlit as st

st.set_page_config(page_title="Miles", layout="wide")
pages = [
    st.Page("views/jobs.py", title="Jobs", icon=":material/list:", default=True),
    st.Page("views/job.py", title="Job", icon=":material/monitoring:"),
    st.Page("views/tune.py", title="Tune", icon=":material/tune:"),
    st.Page("views/compare.py", title="Compare", icon=":material/compare:"),
]
st.navigation(pages).run()
