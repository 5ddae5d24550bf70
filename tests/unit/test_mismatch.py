"""The engine-trainer gap: its diagnostics and corrections by hand, and under context parallelism.
In the real trainer (Megatron Qwen2 on CPU): test_trainer.py; equal to veRL's and slime's own
functions on a shared batch: test_mismatch_peers.py."""
from __future__ import annotations

import math
import threading
from functools import partial

import pytest
import torch

from rollpacker.config import load_config
from rollpacker.configlib import ConfigError
from rollpacker.trainer import mismatch
from rollpacker.trainer.config import MismatchConfig, TrainerConfig
from testkit import REPO_ROOT

# Two responses, then one padding position (no loss, no engine log-prob).
TRAIN = [-1.0, -2.0, -0.5, -0.1, -3.0, -7.0]
ROLLOUT = [-1.2, -1.5, -0.5, -0.1, -2.0, float("nan")]
SEQ = [0, 0, 0, 1, 1, 1]
STARTS = [1, 0, 0, 1, 0, 0]
MASK = [1, 1, 1, 1, 1, 0]


def gap(**kw) -> mismatch.Gap:
    t = partial(torch.tensor, dtype=torch.float64)
    return mismatch.measure(t(TRAIN), t(ROLLOUT), loss_mask=t(MASK), sequence_index=torch.tensor(SEQ),
                            sequence_starts=t(STARTS), num_sequences=2, **kw)


def test_diagnostics_equal_the_hand_computed_values():
    cfg = MismatchConfig(high=1.2, length_buckets=[3])
    m = mismatch.metrics(mismatch.diagnostics(gap(), cfg), cfg)
    d = [tr - ro for tr, ro in zip(TRAIN[:5], ROLLOUT[:5])]  # log r = log pi_train - log pi_rollout
    seqs = [d[:3], d[3:]]
    trains, rollouts = [TRAIN[:3], TRAIN[3:5]], [ROLLOUT[:3], ROLLOUT[3:5]]
    print({k: round(v, 6) for k, v in m.items() if "/" not in k})
    assert m["tokens"] == 5 and m["sequences"] == 2
    assert m["kl_k1"] == pytest.approx(0.26)  # mean(rollout - train) = (-0.2 + 0.5 + 0 + 0 + 1.0) / 5
    assert m["kl_k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 5)
    assert m["chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in d) / 5 - 1)
    assert m["tokens_above"] == pytest.approx(1 / 5)  # exp(0.2) = 1.22 > 1.2
    assert m["tokens_below"] == pytest.approx(2 / 5)  # exp(-0.5), exp(-1) < 1/1.2
    assert m["training_ppl"] == pytest.approx(sum(math.exp(-sum(t) / len(t)) for t in trains) / 2)
    assert m["rollout_ppl"] == pytest.approx(sum(math.exp(-sum(r) / len(r)) for r in rollouts) / 2)
    assert m["log_ppl_diff"] == pytest.approx(sum(-sum(x) / len(x) for x in seqs) / 2)
    assert m["ppl_ratio"] == pytest.approx(sum(math.exp(-sum(x) / len(x)) for x in seqs) / 2)
    assert m["chi2_seq"] == pytest.approx(sum(math.exp(2 * sum(x)) for x in seqs) / 2 - 1)
    assert m["seqs_below"] == 1.0  # exp(-0.3) and exp(-1)
    # the 2-token response in the first bucket, the 3-token one in the second
    assert m["len_0_3/tokens"] == 2 and m["len_0_3/kl_k1"] == pytest.approx(0.5)
    assert m["len_3_up/tokens"] == 3 and m["len_3_up/kl_k1"] == pytest.approx(0.1)


def test_no_engine_logprobs_give_no_diagnostics():
    t = partial(torch.tensor, dtype=torch.float64)
    g = mismatch.measure(t(TRAIN), torch.full((6,), float("nan"), dtype=torch.float64), loss_mask=t(MASK),
                         sequence_index=torch.tensor(SEQ), sequence_starts=t(STARTS), num_sequences=2)
    assert mismatch.metrics(mismatch.diagnostics(g, MismatchConfig()), MismatchConfig()) == {}
    with pytest.raises(ValueError, match="log-prob of every response token"):
        mismatch.correct(g, MismatchConfig(correct="token"))


E = math.exp
CASES = {  # (correct, mode, low) -> (weights, keep) on the five loss tokens, high = 1.2
    ("token", "truncate", None): ([1.2, E(-0.5), 1, 1, E(-1)], [1, 1, 1, 1, 1]),
    ("token", "truncate", 0.5): ([1.2, 0.6065306597126334, 1, 1, 0.5], [1, 1, 1, 1, 1]),
    ("token", "mask", None): ([0, 0, 1, 1, 0], [0, 0, 1, 1, 0]),  # kept in [1/1.2, 1.2]
    ("sequence", "truncate", None): ([E(-0.3)] * 3 + [E(-1)] * 2, [1] * 5),
    ("sequence", "mask", 0.5): ([E(-0.3)] * 3 + [0, 0], [1, 1, 1, 0, 0]),
    ("geometric", "truncate", None): ([E(-0.1)] * 3 + [E(-0.5)] * 2, [1] * 5),
    ("geometric", "mask", None): ([E(-0.1)] * 3 + [0, 0], [1, 1, 1, 0, 0]),  # exp(-0.5) < 1/1.2
}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_each_correction_equals_its_hand_computed_weights(case):
    correct, mode, low = case
    fix = mismatch.correct(gap(), MismatchConfig(correct=correct, mode=mode, high=1.2, low=low))
    weights, keep = CASES[case]
    assert fix.weights.tolist() == pytest.approx([*weights, 0.0])  # padding: no weight
    assert fix.keep.tolist() == [*keep, 0]


def test_rejected_tokens_leave_the_response_length_and_a_response_with_none_left_leaves_the_count():
    g = gap()
    fix = mismatch.correct(g, MismatchConfig(correct="token", mode="mask", high=1.2))
    kept_len, starts = mismatch.kept_responses(g, fix.keep)
    assert kept_len[:5].tolist() == [1, 1, 1, 1, 1]  # one token of each response is kept
    assert starts.tolist() == STARTS
    fix = mismatch.correct(g, MismatchConfig(correct="sequence", mode="mask", high=1.2, low=0.5))
    kept_len, starts = mismatch.kept_responses(g, fix.keep)
    assert kept_len[:5].tolist() == [3, 3, 3, 0, 0] and starts.tolist() == [1, 0, 0, 0, 0, 0]


def _cp_cut(lengths: list[int], cp: int, rank: int) -> list[int]:
    """The token indices context-parallel rank ``rank`` holds: chunks rank and 2cp-1-rank of each sequence."""
    out, start = [], 0
    for n in lengths:
        chunk = n // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out += range(start + c * chunk, start + (c + 1) * chunk)
        start += n
    return sorted(out)


def test_context_parallel_shards_add_up_to_the_whole():
    """Each shard sees part of every response; per-response sums are added over the shards before
    anything nonlinear, so the shards' diagnostics add up to the whole's and every token's weight is
    the whole's."""
    gen = torch.Generator().manual_seed(0)
    lengths, cp = [8, 12, 4], 2
    total = sum(lengths)
    train = -torch.rand(total, generator=gen, dtype=torch.float64) * 3
    rollout = train + torch.randn(total, generator=gen, dtype=torch.float64) * 0.4
    seq = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    starts = torch.tensor([float(j == 0) for n in lengths for j in range(n)], dtype=torch.float64)
    mask = torch.ones(total, dtype=torch.float64)
    cfg = MismatchConfig(correct="geometric", mode="mask", high=1.07, length_buckets=[6])

    def run(idx, reduce=None):
        g = mismatch.measure(train[idx], rollout[idx], loss_mask=mask[idx], sequence_index=seq[idx],
                             sequence_starts=starts[idx], num_sequences=len(lengths), reduce=reduce)
        fix = mismatch.correct(g, cfg)
        return mismatch.diagnostics(g, cfg), fix.weights, mismatch.kept_responses(g, fix.keep)[0]

    whole = run(torch.arange(total))
    shards = [torch.tensor(_cp_cut(lengths, cp, r)) for r in range(cp)]
    # an all-reduce between the shards, each run on its own thread as each would on its own rank
    slots, barrier = [None] * cp, threading.Barrier(cp)

    def all_reduce(rank, t):
        slots[rank] = t.clone()
        barrier.wait()
        total_ = sum(slots)
        barrier.wait()
        return total_

    results = [None] * cp

    def shard(rank):
        results[rank] = run(shards[rank], partial(all_reduce, rank))

    threads = [threading.Thread(target=shard, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert torch.allclose(sum(res[0] for res in results), whole[0], atol=1e-12)
    for idx, (_, weights, kept_len) in zip(shards, results):
        assert torch.allclose(weights, whole[1][idx], atol=1e-12)
        assert torch.equal(kept_len, whole[2][idx])
    assert 0 < float((whole[1] == 0).sum()) < total  # the case rejects some tokens and keeps others


def test_bad_settings_are_refused():
    for bad, match in [(dict(correct="tokens"), "correct"), (dict(mode="clip"), "mode"), (dict(high=1.0), "high"),
                       (dict(low=1.5), "low"), (dict(length_buckets=[512, 256]), "length_buckets")]:
        with pytest.raises(ConfigError, match=match):
            MismatchConfig(**bad).validate()
    with pytest.raises(ConfigError, match="old_logprobs=recompute"):
        TrainerConfig(old_logprobs="engine", mismatch=MismatchConfig(correct="token")).validate()
    with pytest.raises(ConfigError, match=r"tiny-cpu.yaml: trainer.mismatch.high must be > 1"):  # key and file named once
        load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml", ["trainer.mismatch.high=0.5"])
