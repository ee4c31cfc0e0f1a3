"""Measurements behind `miles bench`: `sweep.py` runs a spec's variants; `schedules.py`, `algorithms.py`,
`precision.py` and `weights.py` are the benches over it; `inprocess.py` drives a trainer and an engine in one
process (the precision bench)."""
