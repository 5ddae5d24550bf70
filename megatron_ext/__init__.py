"""What RollPacker adds to megatron-core: the Qwen2/Qwen3 model, weight conversion, CPU compatibility."""
