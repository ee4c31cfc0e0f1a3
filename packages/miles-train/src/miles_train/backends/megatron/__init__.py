"""megatron-core backend: HF ⇄ Megatron conversion, CPU adjustments, the trainer."""
