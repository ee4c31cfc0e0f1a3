"""The service around jobs: the SQL store (`store/`), the REST API (`api/`; its response models, `api/schemas.py`,
are torch-free and ship with the extras-free install), the launcher and its drivers (`launch/`, `driver.py`), the
server's settings (`settings.py`), summaries, reports and export (`summary.py`, `reports.py`, `export.py`) and
queued live schedule changes (`schedule_changes.py`). Imports nothing here: `api.schemas` must load without extras."""
