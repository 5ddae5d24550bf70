"""veRL's and slime's training/inference mismatch corrections, transcribed: veRL here, slime in slime.py.

Test support only. Each function below re-expresses, in plain torch, the maths
of a pinned revision of a peer project so that RollPacker's own implementation
can be compared number-for-number on identical inputs. Nothing here imports
veRL or slime.

Pinned revisions (full hashes):

* veRL HEAD   volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7
* veRL #3915  volcengine/verl@4424616d7dfe03cc564866dc5e99dfaba1daba2e
* slime HEAD  THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
* slime #657  THUDM/slime@ad2ada383aae8fa3cf4cbcd2b61a8f667fbfd4e9
* slime #1933 THUDM/slime@7405851ff1d78941a90e828f182b4854fb746c7a

Conventions of the public wrappers: every tensor argument is ``[B, T]``,
right padded, ``mask`` holds 0/1 floats. Dtype quirks of the peers (``.float()``
casts to float32, thresholds turned into float32 tensors before ``log``) are
reproduced on purpose because they change the last bits of some metrics.

Peer oddities that are kept (search for "PEER QUIRK"):

* veRL ``masked_mean`` divides by ``mask.sum() + 1e-8`` (never exact), slime's
  by ``clamp_min(mask.sum(), 1)``.
* veRL HEAD ``*_k1`` rejection uses ``k1 = -log_ratio = log(pi_rollout/pi_train)``
  against ``[log(lower), log(upper)]``; with an asymmetric ``"lower_upper"`` spec
  the bounds therefore act on pi_rollout/pi_train, not on the IS ratio.
* veRL per-sequence means (ppl, log_ppl_diff, seq_* IS metrics) average over
  *all* B rows, an all-padding row contributing exp(0)=1 to ``training_ppl``.
* veRL #3915 never detaches the weights (HEAD does).
* slime HEAD only runs the veto inside rejection sampling (``use_rs``).
"""

from __future__ import annotations

import math

import torch
SAFETY_BOUND = 20.0

VERL_HEAD = "volcengine/verl@b178a3cd56f5"
VERL_3915 = "volcengine/verl@4424616d7dfe"


# ---------------------------------------------------------------------------
# veRL masked reductions
# ---------------------------------------------------------------------------


def _vf_masked_sum(values, mask, axis=None):
    """veRL ``masked_sum``.

    Source: volcengine/verl@b178a3cd56f5 verl/utils/torch_functional.py:L266-L284
    (identical body at volcengine/verl@4424616d7dfe verl/utils/torch_functional.py:L163-L168).
    Values outside the mask are replaced by 0 before multiplying, so NaN/inf in
    padding cannot leak.
    """
    kept = torch.where(mask.bool(), values, 0.0)
    prod = kept * mask
    return prod.sum() if axis is None else prod.sum(dim=axis)


def _vf_masked_mean(values, mask, axis=None):
    """veRL ``masked_mean``: masked sum over ``mask.sum() + 1e-8``.

    Source: volcengine/verl@b178a3cd56f5 verl/utils/torch_functional.py:L287-L301
    (identical at volcengine/verl@4424616d7dfe verl/utils/torch_functional.py:L171-L185).
    PEER QUIRK: the 1e-8 is always added, so means are never bit-exact averages.
    """
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return _vf_masked_sum(values, mask, axis) / (count + 1e-8)


def _f32_log(x: float) -> torch.Tensor:
    # veRL/slime build thresholds with torch.tensor(python_float) -> default
    # dtype (float32) and then take the log in float32.
    return torch.log(torch.tensor(x))


# ---------------------------------------------------------------------------
# veRL HEAD: IS weights
# ---------------------------------------------------------------------------


def _verl_head_is_metrics(weights, log_ratio_for_metrics, response_mask, level, threshold):
    """veRL HEAD ``compute_is_metrics``.

    Source: volcengine/verl@b178a3cd56f5 verl/trainer/ppo/rollout_corr_helper.py:L601-L713.
    Called on the safety-bounded, padding-zeroed, *not yet truncated* weights.
    """
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    out: dict[str, float] = {}
    lower = 1.0 / threshold
    log_up = _f32_log(threshold)
    log_lo = _f32_log(lower)
    if level == "sequence":
        lmax = log_ratio_for_metrics.max()
        lmin = log_ratio_for_metrics.min()
        out["rollout_is_max"] = torch.exp(torch.clamp(lmax, max=SAFETY_BOUND)).item()
        out["rollout_is_min"] = torch.exp(lmin).item()
        out["rollout_is_mean"] = _vf_masked_mean(weights, response_mask).item()
        # PEER QUIRK: fraction over all B rows (shape [B,1]), padding-only rows included.
        out["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_up).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lo).float().mean().item()
    else:
        out["rollout_is_mean"] = _vf_masked_mean(weights, response_mask).item()
        out["rollout_is_ratio_fraction_high"] = _vf_masked_mean((weights > threshold).float(), response_mask).item()
        out["rollout_is_ratio_fraction_low"] = _vf_masked_mean((weights < lower).float(), response_mask).item()
        valid = response_mask.bool()
        out["rollout_is_max"] = weights.masked_fill(~valid, float("-inf")).max().item()
        out["rollout_is_min"] = weights.masked_fill(~valid, float("inf")).min().item()

    if response_mask.sum() > 1:
        w_c = weights.clamp(min=lower, max=threshold)
        m_c = _vf_masked_mean(w_c, response_mask)
        var = _vf_masked_mean(w_c.square(), response_mask) - m_c.square()
        out["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        out["rollout_is_std"] = 0.0

    w_e = weights.clamp(min=lower, max=threshold)
    w_n = w_e / (_vf_masked_mean(w_e, response_mask) + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / _vf_masked_mean(w_n.square(), response_mask).item()

    if weights.dim() > 1:
        per_seq = _vf_masked_mean(weights, response_mask, axis=-1)
        out["rollout_is_seq_mean"] = per_seq.mean().item()
        out["rollout_is_seq_std"] = per_seq.std().item() if per_seq.numel() > 1 else 0.0
        out["rollout_is_seq_max"] = per_seq.max().item()
        out["rollout_is_seq_min"] = per_seq.min().item()
        out["rollout_is_seq_max_deviation"] = (per_seq - 1.0).abs().max().item()
        out["rollout_is_seq_fraction_high"] = (per_seq > threshold).float().mean().item()
        out["rollout_is_seq_fraction_low"] = (per_seq < lower).float().mean().item()
    return out


def verl_is_weights_with_metrics(
    old_log_prob, rollout_log_prob, response_mask, *, level: str, threshold: float, batch_normalize: bool = False
) -> tuple[torch.Tensor, dict[str, float]]:
    """veRL HEAD IS weights plus their metrics (keys without the ``rollout_corr/`` prefix).

    Sources (volcengine/verl@b178a3cd56f5):
      verl/trainer/ppo/rollout_corr_helper.py:L779 (log_ratio = old_log_prob - rollout_log_prob),
      verl/trainer/ppo/rollout_corr_helper.py:L481-L598 (compute_rollout_correction_weights),
      verl/trainer/ppo/rollout_corr_helper.py:L601-L713 (compute_is_metrics).

    Order: weight = exp(clamp(r, -20, 20)) with r the token log ratio ("token") or
    the masked per-row sum ("sequence", broadcast over T) -> multiply by mask
    (padding = 0) -> metrics -> ``clamp(max=threshold)`` (no lower clamp) ->
    ``detach`` -> optional batch normalisation (non-distributed branch). Only
    "token" and "sequence" exist at HEAD (geometric was removed).
    """
    if level not in {"token", "sequence"}:
        raise ValueError(f"Invalid rollout_is: {level}. Must be one of {{'token', 'sequence'}}.")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be positive, got {threshold}.")
    log_ratio = old_log_prob - rollout_log_prob
    if level == "token":
        lr_metrics = log_ratio
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        row_sum = _vf_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        lr_metrics = row_sum
        weights = torch.exp(torch.clamp(row_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * response_mask
    metrics = _verl_head_is_metrics(weights, lr_metrics, response_mask, level, threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        # Single-process branch only (torch.distributed not initialised).
        if level == "token":
            w_mean = _vf_masked_mean(weights, response_mask)
        else:
            per_seq = _vf_masked_mean(weights, response_mask, axis=-1)
            seq_ok = (response_mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            w_mean = (per_seq * seq_ok).sum() / seq_ok.sum().clamp_min(1e-8)
        if w_mean > 1e-8:
            weights = weights / w_mean
            metrics["rollout_is_batch_norm_factor"] = w_mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def verl_is_weights(
    old_log_prob, rollout_log_prob, response_mask, *, level: str, threshold: float, batch_normalize: bool = False
) -> torch.Tensor:
    """veRL HEAD per-token IS weights ``[B, T]`` (detached, 0 on padding, truncated at ``threshold``).

    Source: volcengine/verl@b178a3cd56f5 verl/trainer/ppo/rollout_corr_helper.py:L481-L598,
    see :func:`verl_is_weights_with_metrics`. Rejection never touches these weights;
    with ``batch_normalize`` padding stays 0 (0 / mean).
    """
    return verl_is_weights_with_metrics(
        old_log_prob, rollout_log_prob, response_mask, level=level, threshold=threshold, batch_normalize=batch_normalize
    )[0]


# ---------------------------------------------------------------------------
# veRL HEAD: rejection sampling
# ---------------------------------------------------------------------------

_VERL_RS_OPTIONS = {
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
}
_VERL_RS_TOKEN_OPTIONS = {"token_k1", "token_k2", "token_k3"}


def _verl_head_parse_rs_thresholds(options, spec):
    """veRL HEAD ``_parse_rollout_rs_thresholds``.

    Source: volcengine/verl@b178a3cd56f5 verl/trainer/ppo/rollout_corr_helper.py:L93-L153.
    One spec shared by all options or one per option (comma separated). ``*_k1``
    options take ``"lower_upper"`` or a bare upper (lower = 1/upper); others a bare upper.
    """
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if isinstance(spec, (int, float)):
        parts = [str(spec)]
    elif isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
    else:
        raise TypeError("rollout_rs_threshold must be a string or a number.")
    if not parts:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(parts) not in (1, len(options)):
        raise ValueError("rollout_rs_threshold needs one shared value or one per option.")
    if len(parts) == 1 and len(options) > 1:
        parts = parts * len(options)
    parsed = {}
    for opt, part in zip(options, parts):
        if opt.endswith("k1"):
            if "_" in part:
                lo_s, up_s = part.split("_", 1)
            else:
                up_s = part
                lo_s = str(1.0 / float(up_s))
            lo, up = float(lo_s), float(up_s)
            if lo <= 0 or up <= 0:
                raise ValueError(f"Thresholds for option '{opt}' must be positive, got {part}.")
            parsed[opt] = {"lower": lo, "upper": up}
        else:
            if "_" in part:
                raise ValueError(f"option '{opt}' takes a single upper bound, got '{part}'.")
            up = float(part)
            if up <= 0:
                raise ValueError(f"Threshold for option '{opt}' must be positive, got {part}.")
            parsed[opt] = {"lower": None, "upper": up}
    return parsed


def _verl_head_rs_metrics(
    name, stat, response_mask, seq_valid, *, level, per_seq, upper, lower, use_lower
) -> dict[str, float]:
    """veRL HEAD ``compute_rs_metrics`` (one option).

    Source: volcengine/verl@b178a3cd56f5 verl/trainer/ppo/rollout_corr_helper.py:L375-L478.
    For k1 options ``upper``/``lower`` are the *log* bounds; for k2/k3 lower is 0.0.
    """
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    out: dict[str, float] = {}
    p = f"rollout_rs_{name}"
    valid = response_mask.bool()
    seq_vals = per_seq if per_seq is not None else _vf_masked_mean(stat, response_mask, axis=-1)
    if seq_vals.dim() > 1:
        seq_vals = seq_vals.squeeze(-1)
    sv = seq_vals[seq_valid]
    out[f"{p}_mean"] = _vf_masked_mean(stat, response_mask).item()
    if level == "sequence" and sv.numel() > 0:
        out[f"{p}_max"] = sv.max().item()
        out[f"{p}_min"] = sv.min().item()
        hi = (sv > upper).float().mean().item()
        lo = (sv < lower).float().mean().item() if use_lower else 0.0
    else:
        out[f"{p}_max"] = stat.masked_fill(~valid, float("-inf")).max().item()
        out[f"{p}_min"] = stat.masked_fill(~valid, float("inf")).min().item()
        hi = _vf_masked_mean((stat > upper).float(), response_mask).item()
        lo = _vf_masked_mean((stat < lower).float(), response_mask).item() if use_lower else 0.0
    out[f"{p}_fraction_high"] = hi
    out[f"{p}_fraction_low"] = lo
    if response_mask.sum() > 1:
        s_c = stat.clamp(min=lower if use_lower else 0.0, max=upper)
        m_c = _vf_masked_mean(s_c, response_mask)
        var = _vf_masked_mean(s_c.square(), response_mask) - m_c.square()
        out[f"{p}_std"] = torch.sqrt(torch.clamp(var, min=0.0)).item()
    else:
        out[f"{p}_std"] = 0.0
    if sv.numel() > 0:
        out[f"{p}_seq_mean"] = sv.mean().item()
        out[f"{p}_seq_std"] = sv.std().item() if sv.numel() > 1 else 0.0
        out[f"{p}_seq_max"] = sv.max().item()
        out[f"{p}_seq_min"] = sv.min().item()
        out[f"{p}_seq_max_deviation"] = (sv - 0.0).abs().max().item()
        out[f"{p}_seq_fraction_high"] = (sv > upper).float().mean().item()
        if use_lower:
            out[f"{p}_seq_fraction_low"] = (sv < lower).float().mean().item()
    else:
        for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                  "seq_fraction_low"):
            out[f"{p}_{k}"] = 0.0
    return out


def verl_rejection_mask_with_metrics(
    old_log_prob, rollout_log_prob, response_mask, *, rollout_rs: str, rollout_rs_threshold
) -> tuple[torch.Tensor, dict[str, float]]:
    """veRL HEAD ``compute_rollout_rejection_mask`` (mask + metrics, keys without prefix).

    Source: volcengine/verl@b178a3cd56f5 verl/trainer/ppo/rollout_corr_helper.py:L156-L372
    (+ L93-L153 threshold parsing, L375-L478 per-option metrics).

    Per token, with r = clamp(old - rollout, -20, 20): k1 = -r, k2 = r**2/2,
    k3 = exp(r) - 1 - r. ``token_kX`` tests each token; ``seq_sum_kX`` /
    ``seq_mean_kX`` the masked per-row sum / mean (mean = sum/(n+1e-8));
    ``seq_max_k{2,3}`` the per-row max (0 for an empty row). k1 keeps
    ``log(lower) <= stat <= log(upper)``, k2/k3 keep ``stat <= upper``. Several
    comma separated options are AND-ed. Returned mask = ``response_mask * keep``.
    """
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string.")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    log_ratio = old_log_prob - rollout_log_prob
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    opts: list[str] = []
    for o in (s.strip() for s in rollout_rs.split(",")):
        if not o:
            continue
        if o not in _VERL_RS_OPTIONS:
            raise ValueError(f"Invalid rollout_rs option: {o}.")
        if o not in opts:
            opts.append(o)
    if not opts:
        raise ValueError("rollout_rs must contain at least one valid option.")
    specs = _verl_head_parse_rs_thresholds(opts, rollout_rs_threshold)

    r = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    k = {"k1": -r, "k2": 0.5 * r**2, "k3": torch.exp(r) - 1.0 - r}
    valid = response_mask.bool()
    seq_valid = response_mask.sum(dim=-1) > 0
    keep_all = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}

    def row_max(v):
        neg_inf = torch.tensor(float("-inf"), device=v.device, dtype=v.dtype)
        m = v.masked_fill(~response_mask.bool(), neg_inf).max(dim=-1).values
        return torch.where(m == neg_inf, torch.zeros_like(m), m)

    for opt in opts:
        is_k1 = opt.endswith("k1")
        up = specs[opt]["upper"]
        lo = specs[opt]["lower"]
        lo_log = math.log(lo) if is_k1 else None
        up_log = math.log(up) if is_k1 else None
        kind = opt[-2:]
        per_seq = None
        if opt in _VERL_RS_TOKEN_OPTIONS:
            level = "token"
            stat = k[kind]
            keep = (stat >= lo_log) & (stat <= up_log) if is_k1 else stat <= up
        else:
            level = "sequence"
            if opt.startswith("seq_sum"):
                s = _vf_masked_sum(k[kind], response_mask, axis=-1)
            elif opt.startswith("seq_mean"):
                s = _vf_masked_mean(k[kind], response_mask, axis=-1)
            else:
                s = row_max(k[kind])
            row_keep = (s >= lo_log) & (s <= up_log) if is_k1 else s <= up
            per_seq = s
            keep = row_keep.unsqueeze(-1).expand_as(valid)
            stat = s.unsqueeze(-1).expand_as(response_mask)

        m_up = up_log if is_k1 else up
        m_lo = lo_log if (is_k1 and lo_log is not None) else 0.0
        keep_f = keep.to(dtype=log_ratio.dtype)
        keep_all = keep_all * keep_f
        row_kept = (~((~keep) & valid)).all(dim=-1)
        metrics.update(
            _verl_head_rs_metrics(
                opt, stat, response_mask, seq_valid, level=level, per_seq=per_seq, upper=m_up, lower=m_lo,
                use_lower=is_k1,
            )
        )
        tok_frac = _vf_masked_mean(1 - keep_f, response_mask).item()
        sv_f = seq_valid.float()
        if sv_f.sum() > 0:
            seq_frac = (((1.0 - row_kept.to(dtype=log_ratio.dtype)) * sv_f).sum() / sv_f.sum()).item()
        else:
            seq_frac = 0.0
        metrics[f"rollout_rs_{opt}_masked_fraction"] = tok_frac
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = seq_frac

    metrics["rollout_rs_masked_fraction"] = _vf_masked_mean(1 - keep_all, response_mask).item()
    final_keep = (keep_all > 0.5) & valid
    # PEER QUIRK: this one averages over all B rows (padding-only rows included).
    metrics["rollout_rs_seq_masked_fraction"] = ((~final_keep & valid).any(dim=-1)).float().mean().item()
    new_mask = (response_mask * keep_all).to(dtype=response_mask.dtype)
    return new_mask, metrics


def verl_rejection_mask(
    old_log_prob, rollout_log_prob, response_mask, *, rollout_rs: str, rollout_rs_threshold
) -> torch.Tensor:
    """veRL HEAD modified ``response_mask`` after rejection sampling.

    Source: volcengine/verl@b178a3cd56f5 verl/trainer/ppo/rollout_corr_helper.py:L156-L372.
    ``rollout_rs``: comma separated subset of token_k1/k2/k3, seq_sum_k1/k2/k3,
    seq_mean_k1/k2/k3, seq_max_k2/k3. ``rollout_rs_threshold``: number or string
    (``"0.5_2.0"`` for k1 lower/upper, one entry per option or one shared).
    """
    return verl_rejection_mask_with_metrics(
        old_log_prob, rollout_log_prob, response_mask, rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold
    )[0]


# ---------------------------------------------------------------------------
# veRL HEAD: off-policy diagnostics
# ---------------------------------------------------------------------------


def verl_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask) -> dict[str, float]:
    """veRL HEAD ``compute_offpolicy_metrics`` (keys without ``rollout_corr/``).

    Source: volcengine/verl@b178a3cd56f5 verl/trainer/ppo/rollout_corr_helper.py:L834-L940.

    * training_ppl / rollout_ppl: mean over the B rows of exp(-row masked mean log-prob).
    * *_log_ppl, log_ppl_diff (= rollout row mean - train row mean), its abs/max/min,
      ppl_ratio = mean over rows of exp(log_ppl_diff): all per row, then over rows.
    * kl = token masked mean of (rollout - old); k3_kl = token masked mean of
      exp(r) - r - 1 with the *unclamped* r = old - rollout.
    * chi2_token = token masked mean of exp(clamp(r))**2 - 1 (over all tokens of the batch).
    * chi2_seq = mean over rows of exp(2 * clamp(row sum r, +-20)) - 1.
    """
    assert response_mask.any(), "Expected at least one valid token in response_mask"
    out: dict[str, float] = {}
    train_row = _vf_masked_mean(old_log_prob, response_mask, axis=-1)
    out["training_ppl"] = torch.exp(-train_row).mean().item()
    out["training_log_ppl"] = (-train_row).mean().item()
    out["kl"] = _vf_masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    r = old_log_prob - rollout_log_prob
    out["k3_kl"] = _vf_masked_mean(torch.exp(r) - r - 1, response_mask).item()
    roll_row = _vf_masked_mean(rollout_log_prob, response_mask, axis=-1)
    out["rollout_ppl"] = torch.exp(-roll_row).mean().item()
    out["rollout_log_ppl"] = (-roll_row).mean().item()
    diff = roll_row - train_row
    out["log_ppl_diff"] = diff.mean().item()
    out["log_ppl_abs_diff"] = diff.abs().mean().item()
    out["log_ppl_diff_max"] = diff.max().item()
    out["log_ppl_diff_min"] = diff.min().item()
    out["ppl_ratio"] = torch.exp(diff).mean().item()
    rho = torch.exp(torch.clamp(r, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    out["chi2_token"] = (_vf_masked_mean(rho.square(), response_mask) - 1.0).item()
    row_sum = torch.clamp(_vf_masked_sum(r, response_mask, axis=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    out["chi2_seq"] = (torch.exp(2.0 * row_sum).mean() - 1.0).item()
    return out


# ---------------------------------------------------------------------------
# veRL HEAD: where the weights enter the loss
# ---------------------------------------------------------------------------


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode: str = "token-mean", *, dp_size: int = 1,
                  batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None) -> torch.Tensor:
    """veRL HEAD ``agg_loss``.

    Source: volcengine/verl@b178a3cd56f5 verl/trainer/ppo/core_algos.py:L1025-L1080.
    The vanilla PPO loss multiplies the *already clipped / dual-clipped* per-token
    loss by ``rollout_is_weights`` (core_algos.py:L1235-L1243) and then calls this
    with ``loss_mask = response_mask``, which the trainer has replaced by the
    rejection-modified mask (rollout_corr_helper.py:L990-L991). So for
    "token-mean" rejected tokens leave both numerator and denominator
    (``batch_num_tokens`` defaults to ``loss_mask.sum()``; the new engines pass
    the DP-reduced sum of that same modified mask).
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return _vf_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_ok = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_ok.sum()
        return _vf_masked_sum(per_seq, seq_ok) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-mean":
        n = torch.sum(loss_mask, dim=-1)
        per_seq = torch.sum(loss_mat * loss_mask, dim=-1) / (n + 1e-8)
        seq_ok = (n > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_ok.sum()
        return _vf_masked_sum(per_seq, seq_ok) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        per_seq = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        return torch.sum(per_seq) / loss_scale_factor
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


# ---------------------------------------------------------------------------
# veRL PR #3915 (mismatch_helper.py)
# ---------------------------------------------------------------------------


def _verl3915_is_metrics(weights, lr_metrics, response_mask, level, upper, lower, log_up, log_lo,
                         has_cat, cat_tokens) -> dict:
    """veRL #3915 ``compute_is_metrics``.

    Source: volcengine/verl@4424616d7dfe verl/trainer/ppo/mismatch_helper.py:L277-L398.
    Receives the safety-bounded weights *before* truncation and before padding is zeroed.
    """
    assert response_mask.any(), "Expected at least one valid sample in response_mask"
    out: dict = {}
    out["rollout_is_veto_fraction"] = has_cat.float().mean()
    out["rollout_is_catastrophic_token_fraction"] = _vf_masked_mean(cat_tokens.float(), response_mask)
    if level in ("sequence", "geometric"):
        out["rollout_is_max"] = torch.exp(torch.clamp(lr_metrics.max(), max=SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(lr_metrics.min())
        out["rollout_is_mean"] = _vf_masked_mean(weights, response_mask)
        hi = lr_metrics > log_up
        lo = lr_metrics < log_lo
        if level == "sequence":
            out["rollout_is_ratio_fraction_high"] = hi.float().mean()
            out["rollout_is_ratio_fraction_low"] = lo.float().mean()
        else:
            # geometric: token-weighted (a row counts once per valid token)
            out["rollout_is_ratio_fraction_high"] = _vf_masked_mean(hi.expand_as(response_mask).float(), response_mask)
            out["rollout_is_ratio_fraction_low"] = _vf_masked_mean(lo.expand_as(response_mask).float(), response_mask)
    else:
        out["rollout_is_mean"] = _vf_masked_mean(weights, response_mask)
        out["rollout_is_ratio_fraction_high"] = _vf_masked_mean((weights > upper).float(), response_mask)
        out["rollout_is_ratio_fraction_low"] = _vf_masked_mean((weights < lower).float(), response_mask)
        valid = response_mask.bool()
        out["rollout_is_max"] = weights.masked_fill(~valid, float("-inf")).max()
        out["rollout_is_min"] = weights.masked_fill(~valid, float("inf")).min()
    if response_mask.sum() > 1:
        w_c = weights.clamp(min=lower, max=upper)
        m_c = _vf_masked_mean(w_c, response_mask)
        var = _vf_masked_mean(w_c.square(), response_mask) - m_c.square()
        out["rollout_is_std"] = torch.sqrt(torch.clamp(var, min=0.0))
    else:
        out["rollout_is_std"] = torch.tensor(0.0)
    w_e = weights.clamp(min=lower, max=upper)
    w_n = w_e / (_vf_masked_mean(w_e, response_mask) + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / _vf_masked_mean(w_n.square(), response_mask)
    if weights.dim() > 1:
        per_seq = _vf_masked_mean(weights, response_mask, axis=-1)
        out["rollout_is_seq_mean"] = per_seq.mean()
        out["rollout_is_seq_std"] = per_seq.std() if per_seq.numel() > 1 else torch.tensor(0.0)
        out["rollout_is_seq_max"] = per_seq.max()
        out["rollout_is_seq_min"] = per_seq.min()
        out["rollout_is_seq_max_deviation"] = (per_seq - 1.0).abs().max()
        out["rollout_is_seq_fraction_high"] = (per_seq > upper).float().mean()
        out["rollout_is_seq_fraction_low"] = (per_seq < lower).float().mean()
    return out


def _verl3915_mismatch_metrics(old_log_prob, rollout_log_prob, response_mask) -> dict[str, float]:
    """veRL #3915 ``compute_mismatch_metrics``: same maths as HEAD's off-policy metrics
    minus chi2, with ``mismatch_`` key prefixes.

    Source: volcengine/verl@4424616d7dfe verl/trainer/ppo/mismatch_helper.py:L401-L488.
    """
    head = verl_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)
    return {f"mismatch_{k}": v for k, v in head.items() if not k.startswith("chi2")}


def verl3915_weights(
    old_log_prob, rollout_log_prob, response_mask, *, level: str, mode: str, upper: float,
    lower: float | None = None, veto_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """veRL #3915 ``compute_rollout_importance_weights`` -> (weights, new mask, metrics).

    Source: volcengine/verl@4424616d7dfe verl/trainer/ppo/mismatch_helper.py:L47-L274
    (metrics L277-L398 and L401-L488). Metric keys are returned without the
    ``mismatch/`` prefix veRL adds at L267-L272.

    * r = old - rollout; token: exp(clamp(r)), sequence: exp(clamp(row sum r)),
      geometric: exp(clamp(row masked mean r)) (mean = sum/(n+1e-8)); +-20 bound.
    * lower defaults to 1/upper.
    * veto (opt-in): a row with any valid token where r < log(veto) (float32 log)
      is zeroed in the mask; weights untouched. Applied in both modes.
    * metrics are taken on the bounded weights before truncation.
    * truncate: weights.clamp(max=upper); mask unchanged (except veto).
      mask: weights keep their safety-bounded value (no threshold clamp);
      mask *= (lower <= w <= upper). Extra metrics rollout_is_masked_fraction,
      rollout_is_seq_masked_fraction (seq/geo: column 0 of the keep mask over all rows).
    * weights are zeroed on padding at the end. PEER QUIRK: not detached.
    """
    upper_t = upper
    lower_t = lower if lower is not None else 1.0 / upper_t
    log_ratio = old_log_prob - rollout_log_prob
    log_up = _f32_log(upper_t)
    log_lo = _f32_log(lower_t)
    if level == "token":
        lr_metrics = log_ratio
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    elif level == "sequence":
        lr_metrics = _vf_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(lr_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(old_log_prob)
    elif level == "geometric":
        lr_metrics = _vf_masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(lr_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(old_log_prob)
    else:
        raise ValueError(f"Invalid rollout_is_level: {level}.")

    if veto_threshold is not None:
        cat_tokens = (log_ratio < _f32_log(veto_threshold)) & response_mask.bool()
        has_cat = cat_tokens.any(dim=-1, keepdim=True)
        veto = (~has_cat).float()
    else:
        cat_tokens = torch.zeros_like(response_mask, dtype=torch.bool)
        has_cat = torch.zeros((old_log_prob.size(0), 1), dtype=torch.bool)
        veto = torch.ones((old_log_prob.size(0), 1), dtype=torch.float32)

    metrics = _verl3915_is_metrics(weights, lr_metrics, response_mask, level, upper_t, lower_t, log_up, log_lo,
                                   has_cat, cat_tokens)
    if mode == "truncate":
        weights = weights.clamp(max=upper_t)
        new_mask = response_mask
    elif mode == "mask":
        keep = ((weights >= lower_t) & (weights <= upper_t)).float()
        metrics["rollout_is_masked_fraction"] = _vf_masked_mean(1 - keep, response_mask)
        if level in ("sequence", "geometric"):
            metrics["rollout_is_seq_masked_fraction"] = (1 - keep[:, 0]).mean()
        else:
            metrics["rollout_is_seq_masked_fraction"] = (
                _vf_masked_sum(1 - keep, response_mask, axis=-1) > 0
            ).float().mean()
        new_mask = response_mask * keep
    else:
        raise ValueError(f"Invalid rollout_is_mode: {mode}.")
    new_mask = new_mask * veto
    weights = weights * response_mask
    metrics.update(_verl3915_mismatch_metrics(old_log_prob, rollout_log_prob, response_mask))
    flat = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
    return weights, new_mask, flat
