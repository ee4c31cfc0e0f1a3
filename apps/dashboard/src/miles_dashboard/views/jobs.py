"""Jobs: the list (status, schedule, progress, age; filters; refreshed by itself) and launching from a preset or
an earlier job's spec, edited as YAML, validated by the API before or as it launches."""

import pandas as pd
import streamlit as st
import yaml

from miles_control.client import ApiError
from miles_dashboard.common import ACTIVE, RETRY_S, age, api
from miles_dashboard.specs import SpecSyntaxError, clone_spec, field_line, gutter_css, numbered, parse_yaml

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
source = st.radio("Start from", ["a preset", "an earlier job"], horizontal=True, key="launch_from")
if source == "a preset":
    presets = {p.name: p.spec_yaml for p in client.presets()}  # the server's presets_dir
    names = sorted(presets)
    if not names:
        st.info(
            "This API server offers no presets: it reads them from its presets folder (`miles serve --presets-dir "
            "DIR`, or MILES_PRESETS_DIR; by default `examples/` of the folder it was started in), which holds no "
            "*.yaml. Paste a job spec below, or start from an earlier job."
        )
    preset = st.selectbox("Preset", names, index=names.index("quick") if "quick" in names else 0, key="preset")
    if preset is not None and st.session_state.get("loaded") != ("preset", preset):
        st.session_state["spec_yaml"] = presets[preset]
        st.session_state["loaded"] = ("preset", preset)
else:
    earlier = {j.id: f"#{j.id} {j.name} ({j.status})" for j in client.jobs(limit=200).items}
    clone = st.selectbox("Job to clone", list(earlier), format_func=earlier.__getitem__, key="clone")
    if clone is not None and st.session_state.get("loaded") != ("job", clone):
        st.session_state["spec_yaml"] = yaml.safe_dump(clone_spec(client.job(clone).spec), sort_keys=False)
        st.session_state["loaded"] = ("job", clone)
# The buttons and what they answer sit above the editor: on a short screen the errors are in view.
controls = st.container()
text = st.text_area("Job spec (YAML)", key="spec_yaml", height=360)
with controls:
    validate_col, launch_col, _ = st.columns([1, 1, 3])
    validate = validate_col.button("Validate", key="validate")
    launch = launch_col.button("Launch", type="primary", key="launch")
    answer = st.container()

READABLE = {  # pydantic's wording → what it means in a job spec
    "Extra inputs are not permitted": "not a field of this section (a typo, or a field of another section or kind)",
    "Field required": "required: this section needs it",
}


def readable(message: str) -> str:
    for raw, meaning in READABLE.items():
        if message.startswith(raw):
            return meaning + message[len(raw) :]
    return message


def refused(exc: ApiError) -> None:
    """The API's field errors, each with its YAML line, and the spec numbered with those lines marked."""
    if not exc.fields:
        st.error(exc.message)
        return
    st.error("The API refused the spec:")
    marks: dict[int, str] = {}
    for path, msg in exc.fields.items():
        line = field_line(text, path)
        st.markdown(f"- {'line ' + str(line) + ' · ' if line else ''}`{path}`: {readable(msg)}")
        if line:
            marks[line] = f"{marks[line]}; {msg}" if line in marks else msg
    if marks:
        st.code(numbered(text, marks), language="yaml")
        st.session_state["spec_marks"] = (text, marks)


if validate or launch:
    with answer:
        try:
            data = parse_yaml(text)
            if validate:
                checked = client.validate_job(data)
            else:
                created = client.create_job(data)
        except SpecSyntaxError as exc:
            st.error(f"Invalid YAML: {exc}")
            if exc.line:
                st.session_state["spec_marks"] = (text, {exc.line: str(exc)})
        except ApiError as exc:
            refused(exc)
        else:
            if validate:
                schedule = checked["schedule"]
                st.success(
                    f"Valid: {checked['name']} would run {schedule['num_steps']} steps on the {schedule['type']} "
                    f"schedule with the {checked['train']['backend']['type']} backend and the "
                    f"{checked['rollout']['engine']['type']} engine."
                )
            else:  # straight to the new job, saying so when the server gave it another name
                asked = data.get("name") if isinstance(data, dict) else None
                if asked and created.name != asked:
                    st.session_state["flash"] = f"launched as {created.name}: the name {asked} is taken"
                st.session_state["job_id"] = created.id
                st.switch_page("views/job.py")

# The editor's gutter: line numbers, and the lines of the last refusal shaded while the text is the one refused.
marked_text, marks = st.session_state.get("spec_marks", ("", {}))
st.markdown(gutter_css("spec_yaml", text.count("\n") + 1, marks if marked_text == text else {}), unsafe_allow_html=True)
