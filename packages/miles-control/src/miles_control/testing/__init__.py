"""Helpers for tests, the model matrix and the benches: `servers.py` (an API server, PostgreSQL databases, Ray
clusters, fresh virtual environments, a Hub cache) and `tiny_models.py` (random-weight models of each family)."""
