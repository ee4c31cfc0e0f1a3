"""Ray runtime: trainer ranks and the rollout side as actors, and the job-level handles over them."""
