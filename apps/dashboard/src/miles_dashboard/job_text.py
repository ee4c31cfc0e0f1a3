"""Text the job page writes from a job's spec and logs (no Streamlit here)."""


def stored_of(job, stored: int) -> str:
    """How many of a step's samples the job stores (`store.samples_per_step`) against how many it generated."""
    rollout = job.spec.get("rollout", {})
    generated = rollout.get("num_prompts_per_step", 0) * rollout.get("num_samples_per_prompt", 0)
    per_step = job.spec.get("store", {}).get("samples_per_step")
    of = f" of the {generated} it generated" if generated else ""
    return (
        f"{stored} sample(s) of this step stored{of}: the job keeps `store.samples_per_step` = {per_step} a step "
        "(the first groups of each batch); raise it in the spec to keep more."
    )


NOISE = ("INFO  [alembic", "INFO [alembic")  # the store's schema check at start-up, not the job's own output


def readable_log(text: str, newest_first: bool) -> str:
    """A log as a person reads it: without the store's set-up lines, and (by default) the newest line first."""
    lines = [line for line in text.splitlines() if not line.startswith(NOISE)]
    return "\n".join(lines[::-1] if newest_first else lines)
