"""Built-in verifiable tasks."""
