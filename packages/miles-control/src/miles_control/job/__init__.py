"""Running one job (the loop): `run.py:run_job`, the checks before any actor (`preflight.py`), the resource plan
(`placement.py`), prompts and model assets (`data.py`, `assets.py`, `hub.py`), the recorder and trackers
(`recorder.py`, `tracking.py`), a job's record as protocols (`journal.py`) and its lifecycle (`status.py`),
`RolloutBatch` → `TrainBatch` (`convert.py`), the Ray runtime (`runtime/`) and the schedules (`schedules/`).
Never imports the service: the caller hands `run_job` the store that implements `journal.py`'s protocols."""
