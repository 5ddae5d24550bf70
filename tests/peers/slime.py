"""slime's training/inference mismatch corrections, transcribed; conventions and pinned revisions
as in verl.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tests.peers.verl import _f32_log  # the float32 log both peers take of a threshold

SAFETY_BOUND = 20.0
SLIME_HEAD = "THUDM/slime@624b824a898a"
SLIME_657 = "THUDM/slime@ad2ada383aae"
SLIME_1933 = "THUDM/slime@7405851ff1d7"

# ---------------------------------------------------------------------------
# slime HEAD: vanilla TIS / icepop (loss.py)
# ---------------------------------------------------------------------------


def slime_tis(train_log_probs, rollout_log_probs, *, clip_low: float = 0.0, clip_high: float = 2.0) -> torch.Tensor:
    """slime HEAD ``vanilla_tis_function`` weights: clamp(exp(train - rollout), clip_low, clip_high).

    Source: THUDM/slime@624b824a898a slime/backends/megatron_utils/loss.py:L884-L905
    (defaults --tis-clip 2.0 / --tis-clip-low 0: slime/utils/arguments.py:L1067-L1077).
    No safety bound, no padding zeroing, no explicit detach (the train log-probs are
    the stored/detached ones, loss.py:L987-L989). Multiplies the PPO-clipped
    per-token pg_loss (loss.py:L1078, after the PPO clip at L1035-L1044); loss masks are returned
    unchanged. Shape-agnostic: works on [B, T] or concatenated 1-D tensors.
    """
    tis = torch.exp(train_log_probs - rollout_log_probs)
    return torch.clamp(tis, min=clip_low, max=clip_high)


def slime_tis_metrics_tokens(train_log_probs, rollout_log_probs, *, clip_low: float = 0.0, clip_high: float = 2.0):
    """Per-token metric tensors of slime HEAD vanilla TIS: tis, tis_clipfrac, tis_abs.

    Source: THUDM/slime@624b824a898a slime/backends/megatron_utils/loss.py:L895-L903.
    Reduce with :func:`slime_reduce_metric` (per-sample mean over the *original*
    mask, loss.py:L1156-L1163). Note #657 had tis_abs = exp(|r|), HEAD has |exp(r) - 1|.
    """
    tis = torch.exp(train_log_probs - rollout_log_probs)
    w = torch.clamp(tis, min=clip_low, max=clip_high)
    return {
        "tis": tis,
        "tis_clipfrac": (w != tis).float(),
        "tis_abs": (torch.exp(train_log_probs - rollout_log_probs) - 1).abs(),
    }


def slime_icepop(train_log_probs, rollout_log_probs, *, clip_low: float = 0.0, clip_high: float = 2.0):
    """slime HEAD ``icepop_function`` weights: ratio if clip_low <= ratio <= clip_high else 0.

    Source: THUDM/slime@624b824a898a slime/backends/megatron_utils/loss.py:L908-L931.
    Rejected tokens keep their place in the denominator (loss masks returned unchanged).
    """
    ratio = torch.exp(train_log_probs - rollout_log_probs)
    return torch.where((ratio >= clip_low) & (ratio <= clip_high), ratio, torch.zeros_like(ratio))


# ---------------------------------------------------------------------------
# slime HEAD: MIS example (examples/train_infer_mismatch_helper/mis.py)
# ---------------------------------------------------------------------------


def _s_masked_sum(x, m, expand=False):
    """slime mis.py ``masked_sum``. Source: THUDM/slime@624b824a898a examples/train_infer_mismatch_helper/mis.py:L12-L14."""
    s = (x * m).sum()
    return s.expand_as(x) if expand else s


def _s_masked_mean(x, m, expand=False):
    """slime mis.py ``masked_mean`` (denominator clamp_min(sum, 1)). Source: same file L17-L19."""
    s = _s_masked_sum(x, m) / torch.clamp_min(m.sum(), 1)
    return s.expand_as(x) if expand else s


def _s_masked_extreme(x, m, expand, op):
    """slime mis.py ``masked_min`` / ``masked_max`` (0 when empty). Source: same file L22-L39."""
    b = m.bool()
    s = getattr(x[b], op)() if b.any() else torch.tensor(0.0, device=x.device, dtype=x.dtype)
    return s.expand_as(x) if expand else s


def _s_append(metrics, key, value):
    """slime mis.py ``metrics_append``. Source: same file L42-L79."""
    metrics.setdefault(key, []).append(value.clone().detach())


def _s_veto(log_ratio, loss_mask, veto_threshold, metrics, prefix=""):
    """slime mis.py ``calculate_veto_mask`` (one sample). Source: same file L82-L100."""
    if veto_threshold is None:
        return torch.ones_like(log_ratio)
    cat = (log_ratio < _f32_log(veto_threshold)) & loss_mask.bool()
    has = cat.any()
    _s_append(metrics, f"{prefix}catastrophic_token_fraction", cat.int())
    _s_append(metrics, f"{prefix}catastrophic_seq_fraction", has.int().expand_as(loss_mask))
    return (~has).float().expand_as(log_ratio)


def _s_truncate(w, loss_mask, metrics, upper, prefix=""):
    """slime mis.py ``truncate``: clamp(0, upper) * mask. Source: same file L103-L113."""
    assert upper is not None
    _s_append(metrics, f"{prefix}truncate_fraction", (w > upper).int())
    return w.clamp(0, upper) * loss_mask


def _s_clip(w, loss_mask, metrics, lower, upper, prefix=""):
    """slime mis.py ``clip``: clamp(lower, upper) * mask. Source: same file L116-L128."""
    assert lower is not None and upper is not None and lower < upper
    _s_append(metrics, f"{prefix}clip_fraction_low", (w < lower).int())
    _s_append(metrics, f"{prefix}clip_fraction_high", (w > upper).int())
    return w.clamp(lower, upper) * loss_mask


def _s_mask(w, loss_mask, metrics, lower, upper, prefix=""):
    """slime mis.py ``mask``: weights kept (only padding zeroed), out-of-range tokens
    leave the mask. Source: same file L131-L147."""
    assert lower is not None and upper is not None and lower < upper
    _s_append(metrics, f"{prefix}mask_fraction_low", (w < lower).int())
    _s_append(metrics, f"{prefix}mask_fraction_high", (w > upper).int())
    keep = (w >= lower) & (w <= upper)
    return w * loss_mask, loss_mask * keep.float()


def _s_ppl_metrics(train, rollout, loss_mask, metrics):
    """slime mis.py ``add_ppl_metrics`` (one sample). Source: same file L383-L451.

    Everything is a per-token tensor; sequence quantities are broadcast so the
    per-sample-mean reducer returns them unchanged. chi2_token is a per-sample
    E[rho^2]-1 (averaged over samples by the reducer, unlike veRL's token mean).
    """
    loss_mask = loss_mask.float()
    tr_mean = _s_masked_mean(train, loss_mask, expand=True)
    _s_append(metrics, "training_log_ppl", -tr_mean)
    _s_append(metrics, "training_ppl", torch.exp(-tr_mean))
    ro_mean = _s_masked_mean(rollout, loss_mask, expand=True)
    _s_append(metrics, "rollout_log_ppl", -ro_mean)
    _s_append(metrics, "rollout_ppl", torch.exp(-ro_mean))
    _s_append(metrics, "kl", rollout - train)
    r = train - rollout
    _s_append(metrics, "k3_kl", torch.exp(r) - r - 1)
    diff = ro_mean - tr_mean
    _s_append(metrics, "log_ppl_diff", diff)
    _s_append(metrics, "log_ppl_abs_diff", diff.abs())
    _s_append(metrics, "ppl_ratio", torch.exp(diff))
    r = train - rollout
    rho = torch.exp(torch.clamp(r, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    _s_append(metrics, "chi2_token", (_s_masked_mean(rho.square(), loss_mask) - 1.0).expand_as(train))
    rs = torch.clamp(_s_masked_sum(r, loss_mask, expand=True), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    _s_append(metrics, "chi2_seq", torch.exp(2.0 * rs) - 1.0)


def slime_compute_mis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """slime HEAD ``compute_mis_weights`` in the peer's own shape (lists of 1-D tensors).

    Source: THUDM/slime@624b824a898a examples/train_infer_mismatch_helper/mis.py:L150-L307.
    ``args`` needs: use_tis, use_rs, tis_level, tis_mode, tis_upper_bound,
    tis_lower_bound, rs_level, rs_lower_bound, rs_upper_bound, rs_veto_threshold,
    tis_batch_normalize. Returns (weights | None, modified masks, metrics lists).
    """
    metrics: dict[str, list[torch.Tensor]] = {}
    tis_lo = args.tis_lower_bound if args.tis_lower_bound is not None else 1.0 / args.tis_upper_bound
    rs_lo = args.rs_lower_bound if args.rs_lower_bound is not None else tis_lo
    rs_up = args.rs_upper_bound if args.rs_upper_bound is not None else args.tis_upper_bound
    assert len(train_log_probs) == len(rollout_log_probs) == len(loss_masks)
    for t, r, m in zip(train_log_probs, rollout_log_probs, loss_masks):
        assert t.shape == r.shape == m.shape

    def level_log_ratio(diff, m, level):
        if level == "token":
            return diff
        if level == "sequence":
            return _s_masked_sum(diff, m, expand=True)
        if level == "geometric":
            return _s_masked_mean(diff, m, expand=True)
        raise ValueError(f"Invalid level: {level}")

    for t, r, m in zip(train_log_probs, rollout_log_probs, loss_masks):
        _s_ppl_metrics(t, r, m, metrics)
    if not args.use_tis:
        return None, loss_masks, metrics

    all_w, all_m = [], []
    for t, r, m in zip(train_log_probs, rollout_log_probs, loss_masks):
        m = m.float()
        diff = t - r
        new_m = m.clone().float()
        if args.use_tis:
            lr_tis = level_log_ratio(diff, m, args.tis_level)
            w = torch.exp(torch.clamp(lr_tis, min=-SAFETY_BOUND, max=SAFETY_BOUND))
            _s_append(metrics, "tis_weight_before_bound", w)
            if args.tis_mode == "truncate":
                w = _s_truncate(w, m, metrics, args.tis_upper_bound, prefix="tis_")
            elif args.tis_mode == "clip":
                w = _s_clip(w, m, metrics, tis_lo, args.tis_upper_bound, prefix="tis_")
            elif args.tis_mode == "mask":
                w, new_m = _s_mask(w, m, metrics, tis_lo, args.tis_upper_bound, prefix="tis_")
            else:
                raise ValueError(f"Unsupported tis_mode: {args.tis_mode}")
            _s_append(metrics, "tis_weight_after_bound", w)
        else:
            w = torch.ones_like(diff)
        if args.use_rs:
            if args.use_tis and args.rs_level == args.tis_level:
                lr_rs = lr_tis
            else:
                lr_rs = level_log_ratio(diff, m, args.rs_level)
            rs_w = torch.exp(torch.clamp(lr_rs, min=-SAFETY_BOUND, max=SAFETY_BOUND))
            _, new_m = _s_mask(rs_w, new_m, metrics, rs_lo, rs_up, prefix="rs_")
            if args.rs_veto_threshold is not None:
                new_m = new_m * _s_veto(diff, m, args.rs_veto_threshold, metrics, prefix="rs_")
        _s_append(metrics, "is_ratio_mean_after_tis_rs", w)
        all_w.append(w.detach())
        all_m.append(new_m.detach())

    if args.tis_batch_normalize:
        lvl = args.tis_level if args.use_tis else "token"
        if lvl == "token":
            tot = sum(_s_masked_sum(w, m) for w, m in zip(all_w, loss_masks))
            cnt = sum(m.sum() for m in loss_masks)
            w_mean = tot / torch.clamp_min(cnt, 1)
        elif lvl == "sequence":
            per = [_s_masked_mean(w, m) for w, m in zip(all_w, loss_masks)]
            w_mean = sum(per) / len(per)
        else:
            raise ValueError(f"Unsupported tis_level: {lvl}")
        if w_mean > 1e-8:
            all_w = [w / w_mean for w in all_w]
            for w in all_w:
                _s_append(metrics, "batch_norm_factor", w_mean.expand_as(w))
        else:
            for w in all_w:
                _s_append(metrics, "batch_norm_factor", torch.ones_like(w))

    for w, m in zip(all_w, loss_masks):
        m = m.float()
        _s_append(metrics, "is_ratio_mean_final", _s_masked_mean(w, m, expand=True))
        _s_append(metrics, "is_ratio_min_final", _s_masked_extreme(w, m, True, "min"))
        _s_append(metrics, "is_ratio_max_final", _s_masked_extreme(w, m, True, "max"))
    return all_w, all_m, metrics


def slime_reduce_metric(values: list[torch.Tensor], loss_masks: list[torch.Tensor],
                        denoms: list | None = None) -> float:
    """How slime HEAD reports a per-token metric list (calculate_per_token_loss=False, 1 rank, no CP).

    Sources: THUDM/slime@624b824a898a slime/backends/megatron_utils/cp_utils.py:L47-L81
    (sum over samples of sum(x*m)/clamp_min(denom, 1)), loss.py:L1156-L1163 (MIS metrics use
    the reducer built on the *original* loss masks), denominators
    ``rollout_mask_sums`` = original mask total of the sample's rollout
    (slime/ray/rollout.py:L685-L700; equals the sample's own original mask sum
    when each rollout yields one sample, the default here), and the final
    division by ``step_global_batch_size`` (loss.py:L1354-L1381, introduced by
    #1933 at THUDM/slime@7405851ff1d7). With one sample per rollout that is B:
    (1/B) * sum_i sum_t m_it x_it / max(D_i, 1).
    """
    if denoms is None:
        denoms = [m.sum() for m in loss_masks]
    total = sum((x * m).sum() / torch.clamp_min(torch.as_tensor(d), 1) for x, m, d in zip(values, loss_masks, denoms))
    return float(total / len(values))


def _rows_to_samples(t: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    # Response length of a right-padded row = last valid position + 1 (0 for an
    # empty row). Every slime op is mask-weighted, so this only keeps padding
    # garbage (e.g. exp overflow in k3_kl) out, exactly as slime never sees it.
    out = []
    for i in range(t.shape[0]):
        nz = torch.nonzero(mask[i]).flatten()
        n = int(nz[-1]) + 1 if nz.numel() else 0
        out.append(t[i, :n])
    return out


def _samples_to_rows(samples: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for i, s in enumerate(samples):
        out[i, : s.shape[0]] = s.to(like.dtype)
    return out


def slime_mis(
    train_log_probs, rollout_log_probs, loss_mask, *, level: str, mode: str, upper: float,
    lower: float | None = None, veto_threshold: float | None = None, batch_normalize: bool = False,
    use_rs: bool = False, rs_level: str | None = None, rs_lower: float | None = None, rs_upper: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """slime HEAD MIS on ``[B, T]`` inputs -> (weights, new loss mask, metrics).

    Wraps :func:`slime_compute_mis_weights` (THUDM/slime@624b824a898a
    examples/train_infer_mismatch_helper/mis.py:L150-L307) with use_tis=True,
    tis_level=level, tis_mode=mode ("truncate" | "clip" | "mask"),
    tis_upper_bound=upper, tis_lower_bound=lower (None -> 1/upper).

    * token: exp(clamp(r)); sequence: exp(clamp(sum r)); geometric:
      exp(clamp(sum r / max(n, 1))); all +-20 bounded.
    * truncate: clamp(0, upper); clip: clamp(lower, upper); mask: weight kept,
      token leaves the mask if outside [lower, upper]. Weights are 0 on
      padding/masked-out (loss_mask=0) positions, detached.
    * Veto exists only inside RS at HEAD (``use_rs``, bounds default to the
      TIS bounds, rs_level defaults to ``level``): a sample with any valid
      token r < log(veto) gets an all-zero mask. Passing ``veto_threshold``
      without ``use_rs=True`` raises, because slime has no standalone veto.
    * batch_normalize: token -> divide by global token mean of the final
      weights over original masks; sequence -> by mean over samples of the
      per-sample masked means; geometric raises (as slime does).

    Metrics: slime's per-token lists reduced by :func:`slime_reduce_metric`
    (per-sample mean over the original mask, then mean over B); keys as
    produced by compute_mis_weights (slime logs them as ``mis_<key>``,
    mis.py:L375-L378). The returned mask is float32 in slime; here it is cast
    to the input dtype (values are exactly 0/1).
    """
    if veto_threshold is not None and not use_rs:
        raise ValueError("slime HEAD applies rs_veto_threshold only with use_rs=True")
    args = SimpleNamespace(
        use_tis=True, use_rs=use_rs, tis_level=level, tis_mode=mode, tis_upper_bound=upper,
        tis_lower_bound=lower, rs_level=rs_level if rs_level is not None else level,
        rs_lower_bound=rs_lower, rs_upper_bound=rs_upper, rs_veto_threshold=veto_threshold,
        tis_batch_normalize=batch_normalize,
    )
    tr = _rows_to_samples(train_log_probs, loss_mask)
    ro = _rows_to_samples(rollout_log_probs, loss_mask)
    lm = _rows_to_samples(loss_mask, loss_mask)
    w, m, met = slime_compute_mis_weights(args, train_log_probs=tr, rollout_log_probs=ro, loss_masks=lm)
    red = {k: slime_reduce_metric(v, lm) for k, v in met.items()}
    return _samples_to_rows(w, train_log_probs), _samples_to_rows(m, loss_mask), red


# ---------------------------------------------------------------------------
# slime per-sample loss normalisation: #657 vs HEAD (#1933)
# ---------------------------------------------------------------------------


def slime_657_sample_mean_loss(per_token_loss, loss_mask_original, loss_mask_after_mis):
    """slime #657 pg-loss reduction when MIS drops tokens. Returns (scalar loss, per-sample means [B]).

    Args:
      per_token_loss: [B, T] PPO-clipped pg loss already multiplied by the IS weights.
      loss_mask_original: [B, T] mask before MIS; in #657 it only fixes the sample
        count (rows are never dropped from the outer mean) and the per-sample
        denominators of the *other* metrics, which this function does not return.
      loss_mask_after_mis: [B, T] modified mask returned by the MIS function.

    Sources (THUDM/slime@ad2ada383aae):
      slime/backends/megatron_utils/loss.py:L464-L472 (reducer rebuilt from the
        modified masks, then pg_loss = sum_of_sample_mean(pg_loss)),
      slime/backends/megatron_utils/cp_utils.py:L59-L65 (per sample
        sum(x*m_mod) / clamp_min(sum(m_mod), 1), summed over samples),
      slime/backends/megatron_utils/loss.py:L656-L689 (times num_microbatches /
        global_batch_size * dp; here 1 micro-batch, 1 rank, global_batch_size = B).

    So in #657 rejected tokens leave the per-sample denominator; a fully rejected
    sample contributes 0 but still counts in B. PEER QUIRK: in #657 the rebuilt
    reducer is also used for pg_clipfrac, ppo_kl, entropy and kl loss.
    """
    B = per_token_loss.shape[0]
    assert loss_mask_original.shape == loss_mask_after_mis.shape
    terms = [
        (per_token_loss[i] * loss_mask_after_mis[i]).sum() / torch.clamp_min(loss_mask_after_mis[i].sum(), 1)
        for i in range(B)
    ]
    # Python ``sum`` over samples (left to right), exactly like slime's reducer.
    return sum(terms) / B, torch.stack(terms)


def slime_head_sample_mean_loss(per_token_loss, loss_mask_original, loss_mask_after_mis, rollout_ids=None):
    """slime HEAD (since #1933) pg-loss reduction. Returns (scalar loss, per-sample terms [B]).

    Numerator uses the modified mask, denominator the *original* mask total of the
    sample's rollout (``rollout_mask_sums``; with ``rollout_ids=None`` each row is
    its own rollout), so rejected tokens stay in the denominator.

    Sources: THUDM/slime@624b824a898a slime/backends/megatron_utils/loss.py:L1080-L1093,
    slime/backends/megatron_utils/cp_utils.py:L67-L81, slime/ray/rollout.py:L685-L700;
    the switch happened in THUDM/slime@7405851ff1d7 (loss.py new-side L928-L944).
    Final division by ``step_global_batch_size`` (loss.py:L1354-L1360; B here).
    """
    B = per_token_loss.shape[0]
    own = [loss_mask_original[i].sum() for i in range(B)]
    if rollout_ids is None:
        denoms = own
    else:
        tot: dict = {}
        for rid, s in zip(rollout_ids, own):
            tot[rid] = tot.get(rid, 0) + s
        denoms = [tot[rid] for rid in rollout_ids]
    terms = [
        (per_token_loss[i] * loss_mask_after_mis[i]).sum() / torch.clamp_min(torch.as_tensor(denoms[i]), 1)
        for i in range(B)
    ]
    return sum(terms) / B, torch.stack(terms)
