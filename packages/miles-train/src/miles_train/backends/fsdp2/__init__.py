"""FSDP2 backend: HF models sharded with `fully_shard`."""
