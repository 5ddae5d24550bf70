"""RollPacker: tail-batching RL post-training on Megatron-core."""
