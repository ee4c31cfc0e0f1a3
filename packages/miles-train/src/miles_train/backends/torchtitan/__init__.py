"""torchtitan backend: a Qwen2/Llama-family torchtitan model, its parallelisation and HF adapter."""
