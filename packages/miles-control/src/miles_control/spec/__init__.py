"""The job spec: its sections (`config.py`: `JobSpec`; the model sources, `model_sources.py`; the schedules'
settings, `schedule.py`), loading a job file with `--set` overrides (`load.py`), the table of every path field
(`paths.py`) and the bounded YAML loader (`yaml_safe.py`). Imports no other room: a spec validates without torch,
Ray or a store."""
