"""Miles dashboard: launch jobs, watch their metrics and per-stage timing, tune schedules, compare runs.

Run with `miles-dashboard` (or `miles dashboard`, or `streamlit run` on this file). It talks to the REST API only
(MILES_API_URL, or the sidebar's connection form, where each visitor signs in with their own token) and imports
nothing of Miles but miles-control's API client and schemas, and no torch."""

import streamlit as st

st.set_page_config(page_title="Miles", layout="wide")
pages = [
    st.Page("views/jobs.py", title="Jobs", icon=":material/list:", default=True),
    st.Page("views/job.py", title="Job", icon=":material/monitoring:"),
    st.Page("views/tune.py", title="Tune", icon=":material/tune:"),
    st.Page("views/compare.py", title="Compare", icon=":material/compare:"),
    st.Page("views/reports.py", title="Reports", icon=":material/description:"),
]
st.navigation(pages).run()
