"""A node's reward pool, shared by the node's ranks: the pool in one rank's process, a
``RewardService`` beside it, a ``RemoteRewardSink`` in every other rank's.

The node's other ranks score exactly what the pool scores in-process (token ids in, decoded by
the workers), a response no scorer takes is refused on the submitter's side with its reason, and a
rank whose pool's process died gets an error for every score it still awaits instead of waiting
for good (every two-rank training test also scores rank 1's responses this way).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rollpacker.control.transport import PeerLostError
from rollpacker.examples.tokenizer import build_tokenizer
from rollpacker.reward import RewardConfig, RewardPool
from rollpacker.reward.service import RemoteRewardSink, RewardService
from rollpacker.reward.sink import PoolRewardSink
from rollpacker.sample import Prompt, Sample
from testkit import REPO_ROOT

ANSWERS = ["The answer is \\boxed{7}.", "It is \\boxed{8}.", "no answer here", "\\boxed{7}"]


def samples(data_source: str = "math") -> list[Sample]:
    tok = build_tokenizer()
    prompt = Prompt(uid=3, input_ids=[1], data_source=data_source, ground_truth="7")
    return [Sample(prompt, r, tok.encode(text).ids) for r, text in enumerate(ANSWERS)]


def test_the_nodes_other_ranks_score_through_the_service_as_the_pool_does():
    with RewardPool(RewardConfig(num_workers=1), tokenizer=build_tokenizer()) as pool:
        assert pool.wait_ready(60)
        service = RewardService(pool)
        sink = RemoteRewardSink(f"tcp://127.0.0.1:{service.port}")
        try:
            remote = [sink.submit(s, key="p3") for s in samples()]
            local = [PoolRewardSink(pool).submit(s, key="p3") for s in samples()]
            got = [(f.result(60).reward, f.result(60).reason) for f in remote]
            want = [(f.result(60).reward, f.result(60).reason) for f in local]
            refused = sink.submit(samples("no-such-source")[0])
            with pytest.raises(ValueError, match="no scorer for data_source 'no-such-source'"):
                refused.result(60)
        finally:
            sink.close()
            service.close()
    print(f"through the service: {got}; in-process: {want}")
    assert got == want and got[0] == (1.0, "ok") and got[1][0] == 0.0


def test_a_sink_whose_pools_process_died_fails_the_scores_it_awaits():
    pool_rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from rollpacker.examples.tokenizer import build_tokenizer
        from rollpacker.reward import RewardConfig, RewardPool
        from rollpacker.reward.service import RewardService
        pool = RewardPool(RewardConfig(num_workers=1, code_t_max=60.0), tokenizer=build_tokenizer())
        pool.wait_ready(60)
        print(RewardService(pool).port, flush=True)
        time.sleep(600)
    """)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        sink = RemoteRewardSink(f"tcp://127.0.0.1:{int(pool_rank.stdout.readline())}")
        tok = build_tokenizer()
        slow = "```python\nimport time\ntime.sleep(30)\nprint('done')\n```"
        prompt = Prompt(uid=0, input_ids=[1], data_source="code", ground_truth=[{"stdin": "", "stdout": "done"}])
        future = sink.submit(Sample(prompt, 0, tok.encode(slow).ids))
        time.sleep(1.0)  # the job is at the pool
        assert not future.done()
        os.killpg(pool_rank.pid, signal.SIGKILL)
        with pytest.raises(PeerLostError, match="reward pool .* hung up"):
            future.result(30)
        with pytest.raises(PeerLostError):
            sink.submit(Sample(prompt, 1, tok.encode(slow).ids))
        sink.close()
    finally:
        if pool_rank.poll() is None:
            os.killpg(pool_rank.pid, signal.SIGKILL)
        pool_rank.wait()
    print("a score awaited from a pool whose process died: PeerLostError, and no later submit is taken")
