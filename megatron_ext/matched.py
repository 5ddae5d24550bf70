"""The trainer's own forward, run by a rollout engine: sampling logits bit-equal to the trainer's.

An engine whose kernels differ from the trainer's samples from a slightly different policy than
the one trained (the engine-trainer gap ``trainer.mismatch`` measures). This removes the gap at
its source instead of correcting for it: the engine runs the same Megatron ``GPTModel`` the CPU
trainer runs (same spec, same fp32 weights, same log-prob function), at the same shape.

Why the shape matters, measured on CPU (torch 2.13, megatron-core's local spec with SDPA): a
row's logits do not depend on the other rows of the batch nor on the tokens after it under the
causal mask, but they do depend on the padded sequence length (attention's key blocking). So
both sides compute on rows of one fixed width, ``window`` tokens: the engine re-runs the whole
window for every decode step (no KV cache; the price of the mode), the trainer pads every
micro-batch row to it. Row ``t`` of the engine's step is then bit-equal to row ``t`` of the
trainer's forward of the finished sequence.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.logprobs import token_logprobs
from megatron_ext.model import build_model
from megatron_ext.weights import HFLoader, load_hf_checkpoint

# every model-parallel group a TP=1, single-stage GPTModel is given: this process alone
_GROUPS = ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "dp", "dp_cp")


def _own_groups() -> ProcessGroupCollection:
    """Groups of this rank alone, made without the other ranks (local synchronisation), so an
    engine can build its model while the rest of the job does something else."""
    if not dist.is_initialized():
        raise RuntimeError("the trainer-matched forward builds a Megatron model: initialise torch.distributed first")
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    pgs = ProcessGroupCollection()
    for name in _GROUPS:
        setattr(pgs, name, group)
    return pgs


class TrainerForward:
    """An unsharded fp32 copy of the trainer's model, evaluated at a fixed row width."""

    def __init__(self, hf_dir: str | Path, window: int, device: str | torch.device = "cpu"):
        self.window = window
        self.model = build_model(hf_dir, pg_collection=_own_groups()).to(device)
        load_hf_checkpoint(self.model, hf_dir)
        self.model.train(False)
        self.spec = self.model.hf_spec
        self.loader = HFLoader(self.model)
        self.device = torch.device(device)

    @torch.no_grad()
    def logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits ``[len(rows), window, padded vocab]`` of token rows, each right-padded to the window."""
        ids = torch.zeros(len(rows), self.window, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.as_tensor(r)
        positions = torch.arange(self.window).expand(len(rows), -1)
        # right padding + causal attention, as the CPU trainer feeds its micro-batches
        return self.model(ids.to(self.device), positions.to(self.device), attention_mask=None)

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """log p(tokens) per row of ``logits [n, padded vocab]``: the trainer's function."""
        return token_logprobs(logits, tokens, self.model.pg_collection.tp, vocab_size=self.spec.vocab_size)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.loader.load(named_tensors)

    def max_diff(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        return self.loader.max_diff(named_tensors)

    def release(self) -> None:
        for p in self.model.parameters():
            p.data.untyped_storage().resize_(0)

    def allocate(self) -> None:
        for p in self.model.parameters():
            storage = p.data.untyped_storage()
            if storage.size() == 0:
                storage.resize_(p.numel() * p.element_size())
