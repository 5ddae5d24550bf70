"""Bounds the tests share.

The sync check of a step on CPU: the reference engine reads its weights back (exact); SGLang cannot,
so the trainer's log-probs of the engine's samples must agree with the engine's own. In fp32 on CPU
the largest per-token gap (``train/logprob_mismatch_max``) is 2.9e-6 on SGLang and 4.5e-6 on the
reference engine (tests/integration/test_stale_sync.py prints both); a stale or missed weight sync
is orders of magnitude above the bound.
"""
CPU_SYNC_BOUND = 3e-5
