"""Synthetic prompt groups for trainer tests (random tokens, binary rewards, varied lengths)."""
from __future__ import annotations

import random

from rollpacker.sample import Prompt, Sample


def random_groups(seed: int, *, num_groups: int = 6, group_size: int = 4, vocab: int = 250,
                  prompt_len: tuple[int, int] = (3, 9), response_len: tuple[int, int] = (1, 24),
                  with_logprobs: bool = False) -> list[list[Sample]]:
    """Prompt groups with rewards in {0, 1}; every group holds both rewards so advantages are non-zero."""
    rng = random.Random(seed)
    groups = []
    for uid in range(num_groups):
        prompt = Prompt(uid=uid, input_ids=[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))],
                        data_source="synthetic")
        group = []
        for i in range(group_size):
            n = rng.randint(*response_len)
            group.append(Sample(prompt=prompt, response_index=i, response_ids=[rng.randrange(vocab) for _ in range(n)],
                                rollout_logprobs=[-rng.uniform(1, 6) for _ in range(n)] if with_logprobs else [],
                                finish_reason="stop", reward=float(i % 2)))
        groups.append(group)
    return groups
