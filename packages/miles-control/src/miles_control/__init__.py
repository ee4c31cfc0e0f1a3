"""miles_control: the job spec, schedules, the Ray runtime, the SQL store and the `miles` CLI."""
