"""Balancing and packing invariants; the padded (CPU) and packed THD (GPU) layouts carry the same tokens."""
from __future__ import annotations

import random

import pytest
import torch

from rollpacker.trainer import mismatch
from rollpacker.trainer.grpo import grpo_token_loss
from rollpacker.trainer.packing import (MICRO_BATCH_OVERHEAD_TOKENS, balance, build_micro_batch, pack,
                                       plan_micro_batches, sequence_length)
from tests.dist.trainer_fixtures import random_groups


def _lengths(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.paretovariate(1.2) * 20) for _ in range(n)]  # long-tailed, like responses


@pytest.mark.parametrize("seed,n,bins", [(0, 37, 2), (1, 64, 4), (2, 3, 4), (3, 0, 2), (4, 100, 8)])
def test_balance_invariants(seed, n, bins):
    lengths = _lengths(seed, n)
    parts = balance(lengths, bins)
    assert len(parts) == bins
    assert sorted(i for p in parts for i in p) == list(range(n))  # every item exactly once
    assert all(p == sorted(p) for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    if n:  # greedy LPT: the heaviest bin is within one item of the mean
        assert max(loads) - sum(loads) / bins <= max(lengths)
    assert balance(lengths, bins) == parts  # deterministic


def test_balance_beats_round_robin_on_a_long_tail():
    lengths = _lengths(5, 64)
    round_robin = [sum(lengths[i::4]) for i in range(4)]
    greedy = [sum(lengths[i] for i in p) for p in balance(lengths, 4)]
    assert max(greedy) <= max(round_robin)
    assert max(greedy) - min(greedy) <= max(lengths)


@pytest.mark.parametrize("budget", [1, 30, 100, 10_000])
def test_pack_invariants(budget):
    lengths = _lengths(6, 50)
    batches = pack(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(50))
    for b in batches:
        assert sum(lengths[i] for i in b) <= budget or len(b) == 1  # an over-long item rides alone
    if budget >= max(lengths):  # first-fit decreasing never needs more than 11/9 OPT + 1 bins
        assert len(batches) <= 11 / 9 * (sum(lengths) / budget) + 2
    assert pack(lengths, budget) == batches


def _padded_cost(lengths, batches):
    return sum(len(b) * max(lengths[i] for i in b) + MICRO_BATCH_OVERHEAD_TOKENS for b in batches)


@pytest.mark.parametrize("budget", [1, 200, 4096])
def test_padded_pack_bounds_rows_times_width(budget):
    lengths = _lengths(7, 64)
    batches = pack(lengths, budget, "padded")
    assert sorted(i for b in batches for i in b) == list(range(64))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= budget or len(b) == 1
    assert pack(lengths, budget, "padded") == batches


def test_padded_pack_keeps_a_long_row_away_from_short_ones():
    lengths = [40] * 31 + [480]
    batches = pack(lengths, 4096, "padded")
    assert [31] in batches  # sharing would pad 31 short rows to 480: 15,360 tokens for 1,720 real
    assert _padded_cost(lengths, batches) < _padded_cost(lengths, pack(lengths, 4096, "thd")) / 3


def test_padded_pack_is_the_cheapest_split_of_the_sorted_rows():
    """Against brute force over every way to cut the length-sorted rows into runs."""
    import itertools
    rng = random.Random(8)
    for _ in range(20):
        lengths = [rng.choice([5, 30, 60, 200]) + rng.randrange(10) for _ in range(rng.randint(1, 9))]
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        best = None
        for cuts in itertools.product([0, 1], repeat=len(order) - 1):
            runs, run = [], [order[0]]
            for c, i in zip(cuts, order[1:]):
                if c:
                    runs.append(run)
                    run = []
                run.append(i)
            runs.append(run)
            if all(len(r) * lengths[r[0]] <= 600 or len(r) == 1 for r in runs):
                cost = _padded_cost(lengths, runs)
                best = cost if best is None else min(best, cost)
        assert _padded_cost(lengths, pack(lengths, 600, "padded")) == best


def test_micro_batch_positions_and_mask():
    s = random_groups(0, num_groups=1, group_size=1)[0][0].replace(advantage=0.5)
    p, r = len(s.prompt.input_ids), len(s.response_ids)
    mb = build_micro_batch([s], aggregation="seq_mean", layout="padded")
    tokens = s.prompt.input_ids + s.response_ids
    assert mb.input_ids[0].tolist() == tokens
    # position i predicts token i+1: the loss covers exactly the response tokens
    assert mb.labels[0][mb.loss_mask[0] > 0].tolist() == s.response_ids
    assert int(mb.loss_mask.sum()) == r and int(mb.sequence_starts.sum()) == 1
    assert mb.loss_mask[0, p - 1] == 1 and mb.sequence_starts[0, p - 1] == 1
    assert mb.weights[0, 0].item() == pytest.approx(1 / r)


def test_padded_and_thd_layouts_have_identical_numerics():
    samples = [s.replace(advantage=float(i % 3) - 1) for i, s in
               enumerate(x for g in random_groups(1, num_groups=3, with_logprobs=True) for x in g)]
    padded = build_micro_batch(samples, aggregation="seq_mean", layout="padded")
    thd = build_micro_batch(samples, aggregation="seq_mean", layout="thd", pad_multiple=4)
    assert thd.input_ids.shape[0] == 1 and padded.input_ids.shape[0] == len(samples)
    assert (thd.cu_seqlens.diff() % 4 == 0).all()
    assert thd.cu_seqlens_unpadded.diff().tolist() == [sequence_length(s) for s in samples]
    assert thd.num_tokens == padded.num_tokens

    def loss(mb):  # a stand-in "model": log-prob that depends on token, label and position
        logp = -(mb.input_ids * 7 + mb.labels * 3 + mb.position_ids).remainder(11).double() / 5 - 0.1
        sums = grpo_token_loss(logp, advantages=mb.advantages, loss_mask=mb.loss_mask, weights=mb.weights,
                               clip_low=0.2, clip_high=0.28, old_logprobs=logp.detach() - 0.3 * mb.advantages,
                               sequence_starts=mb.sequence_starts)
        gap = mismatch.measure(logp, mb.rollout_logprobs, loss_mask=mb.loss_mask, sequence_index=mb.sequence_index,
                               sequence_starts=mb.sequence_starts, num_sequences=mb.num_sequences)
        sums.logprob_mismatch, sums.logprob_mismatch_max, sums.mismatch_tokens = mismatch.sync_check(gap)
        return sums

    a, b = loss(padded), loss(thd)
    assert all(torch.allclose(x, y, rtol=1e-12, atol=1e-12) for x, y in zip(a.as_vectors(), b.as_vectors()))
    assert float(a.clipped) > 0  # the check covers the clipped branch too


def test_plan_respects_budget_and_refuses_untrainable_samples():
    samples = [s.replace(advantage=1.0) for g in random_groups(2, num_groups=4) for s in g]
    mbs = plan_micro_batches(samples, budget=40, aggregation="token_mean", layout="padded")
    assert sum(mb.num_tokens for mb in mbs) == sum(sequence_length(s) for s in samples)
    assert all(mb.num_tokens <= 40 or mb.input_ids.shape[0] == 1 for mb in mbs)
    with pytest.raises(ValueError, match="no advantage"):
        build_micro_batch([samples[0].replace(advantage=None)], aggregation="token_mean", layout="padded")
    with pytest.raises(ValueError, match="no response tokens"):
        build_micro_batch([samples[0].replace(response_ids=[])], aggregation="token_mean", layout="padded")
    with pytest.raises(ValueError, match="rollout log-probs"):
        build_micro_batch([samples[0].replace(rollout_logprobs=[-1.0] * 999)], aggregation="token_mean",
                          layout="padded")


def test_gpu_thd_hand_off_keeps_the_packing():
    """Without context parallelism the GPU backend passes the packed batch through untouched."""
    from rollpacker.trainer.backend_gpu import cp_shard
    samples = [s.replace(advantage=1.0) for s in random_groups(3, num_groups=1)[0]]
    mb = build_micro_batch(samples, aggregation="token_mean", layout="thd", pad_multiple=1)
    shard, params = cp_shard(mb, cp=1, cp_rank=0)
    assert torch.equal(shard.input_ids, mb.input_ids) and torch.equal(shard.loss_mask, mb.loss_mask)
    assert params.qkv_format == "thd" and params.max_seqlen_q == mb.max_seqlen
    assert torch.equal(params.cu_seqlens_q, mb.cu_seqlens_unpadded)
    assert torch.equal(params.cu_seqlens_q_padded, mb.cu_seqlens)


def test_balance_counts_each_bins_starting_load():
    # a replica that streamed 10 tokens during rollout gets less of what is left
    bins = balance([4, 3, 3, 2], 2, start=[10, 0])
    loads = [10 + sum([4, 3, 3, 2][i] for i in bins[0]), sum([4, 3, 3, 2][i] for i in bins[1])]
    assert bins[0] == [3] and loads == [12, 10]  # without the start it would take 6 of the 12
    assert balance([4, 3, 3, 2], 2, start=[0, 0]) == balance([4, 3, 3, 2], 2)


def _thd_partitioned_indices(cu_seqlens_padded, total, cp, rank):
    """Transformer Engine's THD context-parallel cut, in plain torch (TE has no CPU build): every padded
    sequence in 2*cp chunks, rank r takes chunks r and 2*cp-1-r."""
    index = []
    for a, b in zip(cu_seqlens_padded[:-1].tolist(), cu_seqlens_padded[1:].tolist()):
        chunk = (b - a) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            index.extend(range(a + c * chunk, a + (c + 1) * chunk))
    return torch.tensor(index)


def test_kl_reference_logprobs_stay_aligned_under_context_parallelism(monkeypatch):
    """The KL reference pass runs on a context-parallel shard; the training pass must read those values at
    the same tokens (they were once re-cut with full-length indices: wrong values or an index error)."""
    import types

    from megatron.core import utils as mcore_utils

    from rollpacker.trainer.backend_gpu import cp_shard
    monkeypatch.setattr(mcore_utils, "tex", types.SimpleNamespace(thd_get_partitioned_indices=_thd_partitioned_indices))
    monkeypatch.setattr(mcore_utils, "is_te_min_version", lambda *a, **k: True)
    samples = [s.replace(advantage=1.0) for s in random_groups(5, num_groups=2)[0]]
    cp = 2
    mb = build_micro_batch(samples, aggregation="token_mean", layout="thd", pad_multiple=2 * cp)
    token_value = torch.arange(mb.input_ids.shape[1], dtype=torch.float64)[None] * 0.5  # a value per token
    for rank in range(cp):
        shard, _ = cp_shard(mb, cp, rank)
        # the reference pass (forward-only, this shard) yields one value per shard token
        mb.ref_logprobs = token_value[:, _thd_partitioned_indices(mb.cu_seqlens, 0, cp, rank)]
        train_shard, _ = cp_shard(mb, cp, rank)
        assert train_shard.ref_logprobs.shape == train_shard.loss_mask.shape
        assert torch.equal(train_shard.ref_logprobs, mb.ref_logprobs)
        assert torch.equal(train_shard.input_ids, shard.input_ids)
        mb.ref_logprobs = None
