"""What RollPacker adds to megatron-core: the Qwen2 model, weight conversion, CPU compatibility."""
