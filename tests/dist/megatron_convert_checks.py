"""Under ``torchrun --nproc_per_node 2``: TP=2 parity and TP=2 / PP=2 conversion round trips.

Usage: megatron_convert_checks.py TIED_HF_DIR UNTIED_HF_DIR OUT_DIR
Runs the ``--verify`` CLI at TP=2 on the untied checkpoint (its verdict line is
printed), writes OUT_DIR/{tp2,pp2}_{tied,untied}/ (HF checkpoints after
HF -> mcore -> HF) and prints one line ``RESULT {json}``: the CLI's exit code,
the TP=2 parity of the tied checkpoint, and the errors of vocab-parallel
log-probs / entropy / their gradients (max over TP ranks).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ext.conversion import hf_to_mcore, mcore_to_hf, verify
from megatron_ext.convert import main as convert_cli
from megatron_ext.logprobs import token_entropy, token_logprobs
from megatron_ext.parallel import ParallelLayout, setup_layout, teardown_layout


def logprob_grad_errors(layout: ParallelLayout, vocab: int = 250, padded: int = 256) -> dict[str, float]:
    """Vocab-parallel log-probs / entropy and their gradients against a full-vocabulary reference."""
    logits = torch.randn(3, 7, padded, generator=torch.Generator().manual_seed(0))
    logits[..., vocab:] = 30.0  # padding columns would dominate the softmax if not masked
    labels = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(1))
    width = padded // layout.tp
    shard = logits[..., layout.tp_rank * width:(layout.tp_rank + 1) * width].clone().requires_grad_()
    logp = token_logprobs(shard, labels, layout.tp_group, vocab_size=vocab)
    entropy = token_entropy(shard, layout.tp_group, vocab_size=vocab)
    (logp.sum() + 0.5 * entropy.sum()).backward()
    ref = logits[..., :vocab].clone().requires_grad_()
    ref_logp = torch.log_softmax(ref, dim=-1)
    ref_lp, ref_entropy = ref_logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(ref_logp.exp() * ref_logp).sum(-1)
    (ref_lp.sum() + 0.5 * ref_entropy.sum()).backward()
    full_grad = torch.cat([ref.grad, torch.zeros(3, 7, padded - vocab)], dim=-1)  # padding gets no gradient
    errors = torch.stack([(logp - ref_lp).abs().max(), (entropy - ref_entropy).abs().max(),
                          (shard.grad - full_grad[..., layout.tp_rank * width:(layout.tp_rank + 1) * width]).abs().max()])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=layout.tp_group)
    return dict(zip(("logprob_value", "entropy_value", "grad"), errors.tolist()))


def main(tied: Path, untied: Path, out: Path) -> None:
    torch.set_num_threads(1)
    cli_exit_code = convert_cli(["--verify", str(untied), "--tp", "2"])  # prints its verdict on rank 0
    layout = setup_layout(tp=2)
    errors = logprob_grad_errors(layout)
    parity = verify(tied, layout)
    for name, hf_dir in (("tied", tied), ("untied", untied)):
        hf_to_mcore(hf_dir, out / f"mcore_tp2_{name}", layout)
        mcore_to_hf(out / f"mcore_tp2_{name}", out / f"tp2_{name}", layout)
    teardown_layout(layout)

    layout = setup_layout(pp=2)
    for name, hf_dir in (("tied", tied), ("untied", untied)):
        hf_to_mcore(hf_dir, out / f"mcore_pp2_{name}", layout)
        mcore_to_hf(out / f"mcore_pp2_{name}", out / f"pp2_{name}", layout)
    if layout.is_writer:
        result = {"cli_exit_code": cli_exit_code, "logprob_diff": parity.logprob_diff,
                  "entropy_diff": parity.entropy_diff, **errors}
        print("RESULT " + json.dumps(result), flush=True)
    teardown_layout(layout)


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:4]))
