"""Jobs: the list (status, schedule, progress, age; filters; refreshed by itself) and launching from a preset or
YAML."""

import pandas as pd
import streamlit as st
from common import ACTIVE, RETRY_S, age, api
from specs import SpecSyntaxError, field_line, parse_yaml

from miles_control.client import ApiError

client = api()
st.title("Jobs")


@st.fragment(run_every=RETRY_S)
def job_list() -> None:
    """The list, refreshed every few seconds (new jobs, progress, status)."""
    left, right = st.columns([2, 1])
    statuses = left.multiselect(
        "Status", ["queued", "starting", "running", "succeeded", "failed", "cancelled"], key="filter_status"
    )
    name = right.text_input("Name contains", key="filter_name")
    page = client.jobs(status=statuses or None, name=name or None, limit=200)
    jobs = page.items
    st.caption(f"{page.total} job(s); {sum(j.status in ACTIVE for j in jobs)} active")
    if jobs:
        table = pd.DataFrame(
            [
                {
                    "id": j.id,
                    "name": j.name,
                    "status": j.status,
                    "schedule": j.schedule,
                    "progress": (j.last_step or 0) / max(j.num_steps, 1),
                    "step": f"{j.last_step or 0}/{j.num_steps}",
                    "created": age(j.created_at),
                    "error": j.error or "",
                }
                for j in jobs
            ]
        )
        st.dataframe(
            table,
            hide_index=True,
            width="stretch",
            column_config={"progress": st.column_config.ProgressColumn("progress", min_value=0, max_value=1)},
        )
        labels = {j.id: f"#{j.id} {j.name} ({j.status})" for j in jobs}  # ids: a refresh keeps the choice
        chosen = st.selectbox("Open", list(labels), format_func=labels.__getitem__, key="open")
        if st.button("Open job", key="open_job"):
            st.session_state["job_id"] = chosen
            st.switch_page("views/job.py")
    else:
        st.info("No jobs match." if statuses or name else "No jobs yet: launch one below.")


job_list()

st.header("Launch")
presets = {p.name: p.spec_yaml for p in client.presets()}  # the server's presets_dir
names = sorted(presets)
preset = st.selectbox("Preset", names, index=names.index("quick") if "quick" in names else 0, key="preset")
if preset is not None and st.session_state.get("loaded_preset") != preset:
    st.session_state["spec_yaml"] = presets[preset]
    st.session_state["loaded_preset"] = preset
text = st.text_area("Job spec (YAML)", key="spec_yaml", height=360)
if st.button("Launch", type="primary", key="launch"):
    try:
        created = client.create_job(parse_yaml(text))
    except SpecSyntaxError as exc:
        st.error(f"Invalid YAML: {exc}")
    except ApiError as exc:
        if exc.fields:
            st.error("The API refused the spec:")
            for path, msg in exc.fields.items():
                line = field_line(text, path)
                st.markdown(f"- {'line ' + str(line) + ' · ' if line else ''}`{path}`: {msg}")
        else:
            st.error(exc.message)
    else:
        st.session_state["job_id"] = created.id
        st.session_state["launched"] = created
        st.rerun()  # so that the list above shows the new job
if launched := st.session_state.get("launched"):
    st.success(f"Job #{launched.id} ({launched.name}) is {launched.status}.")
    st.page_link("views/job.py", label=f"Watch job #{launched.id}", icon=":material/monitoring:")
