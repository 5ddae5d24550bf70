"""Under ``torchrun --nproc_per_node 2``: a Qwen3-MoE checkpoint's log-prob parity with transformers at
EP=2 and TP=2, and bit-identical round trips through Megatron at EP=2 (the weight sync's export),
TP=2 and PP=2 (the mcore format).

Usage: moe_checks.py HF_DIR OUT_DIR. Rank 0 prints one line ``RESULT {json}``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_ext.conversion import hf_to_mcore, mcore_to_hf, verify
from megatron_ext.model import build_model
from megatron_ext.parallel import setup_layout, teardown_layout
from megatron_ext.weights import iter_hf_tensors, load_hf_checkpoint


def main(hf_dir: Path, out: Path) -> None:
    torch.set_num_threads(1)
    source = load_file(str(hf_dir / "model.safetensors"))
    result = {}
    layout = setup_layout(ep=2)
    parity = verify(hf_dir, layout)
    model = build_model(hf_dir, pg_collection=layout.pg_collection)
    load_hf_checkpoint(model, hf_dir)
    local = sum(1 for n, _ in model.named_parameters() if "local_experts" in n)
    exported = dict(iter_hf_tensors(model, layout))
    result.update(ep2_logprob_diff=parity.logprob_diff, ep2_entropy_diff=parity.entropy_diff,
                  ep2_local_expert_params=local, ep2_export_names_equal=sorted(exported) == sorted(source),
                  ep2_export_max_diff=max((exported[k] - source[k]).abs().max().item() for k in source))
    teardown_layout(layout)

    layout = setup_layout(tp=2)
    parity = verify(hf_dir, layout)
    result.update(tp2_logprob_diff=parity.logprob_diff, tp2_entropy_diff=parity.entropy_diff)
    hf_to_mcore(hf_dir, out / "mcore_tp2", layout)
    mcore_to_hf(out / "mcore_tp2", out / "tp2", layout)
    teardown_layout(layout)

    layout = setup_layout(pp=2)
    hf_to_mcore(hf_dir, out / "mcore_pp2", layout)
    mcore_to_hf(out / "mcore_pp2", out / "pp2", layout)
    if layout.is_writer:
        print("RESULT " + json.dumps(result), flush=True)
    teardown_layout(layout)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
