"""Environments users bring from the open hubs: Prime Intellect's `verifiers` (`hubs.verifiers_env`) and Meta's
OpenEnv (`hubs.openenv_env`). Each is an optional dependency (`pip install 'miles-rollout[hubs]'`), imported only
by a job that names one in `rollout.environment`."""
