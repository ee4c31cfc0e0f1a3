"""The `miles` command line: `entry.py` (the console script), `main.py` (run, export, data, schedule),
`control.py` (serve, dashboard, jobs, tokens), `bench.py` (the `bench` commands), `common.py` (spec loading)."""
