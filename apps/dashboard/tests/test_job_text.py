"""The job page's text from a job's spec and logs."""

from types import SimpleNamespace

from miles_dashboard.job_text import readable_log, stored_of


def test_stored_samples_are_counted_against_those_the_job_generated():
    job = SimpleNamespace(
        spec={"rollout": {"num_prompts_per_step": 16, "num_samples_per_prompt": 8}, "store": {"samples_per_step": 32}}
    )
    said = stored_of(job, 32)
    assert said.startswith("32 sample(s) of this step stored of the 128 it generated"), said
    assert "= 32 a step" in said
    assert "it generated" not in stored_of(SimpleNamespace(spec={}), 3)  # unknown: not claimed as 0


def test_a_log_reads_newest_first_without_the_stores_setup_lines():
    text = "INFO  [alembic.runtime] setup\nstep 1\nstep 2"
    assert readable_log(text, newest_first=True) == "step 2\nstep 1"
    assert readable_log(text, newest_first=False) == "step 1\nstep 2"
