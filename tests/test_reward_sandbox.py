"""Hostile programs through the real pool: each is scored as a failure with the right reason
within T_max + 2 s, the pool keeps serving, and the host is unaffected."""
from __future__ import annotations

import os
import socket

import psutil
import pytest

from rollpacker.reward import RewardConfig, RewardPool

T_MAX = 3.0
SECRET = "rp-test-secret-7f3a"
ECHO = [{"stdin": "5\n", "stdout": "10\n"}]


def program(source: str) -> str:
    return f"Here is my solution.\n```python\n{source}\n```\n"


@pytest.fixture(scope="module")
def pool():
    os.environ["RP_TEST_SECRET"] = SECRET  # the workers inherit it; sandboxed programs must not
    # spawn: the workers see the environment as it is now (a fork server may predate the secret)
    cfg = RewardConfig(num_workers=2, code_t_min=1.0, code_t_max=T_MAX, worker_grace=2.0, code_memory_mb=256,
                       start_method="spawn")
    with RewardPool(cfg) as p:
        assert p.wait_ready(60)
        yield p
    del os.environ["RP_TEST_SECRET"]


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    yield server
    server.close()


def hostile_programs(outside: str, port: int) -> dict[str, tuple[str, str]]:
    """name -> (program, expected reason)."""
    return {
        "infinite_loop": ("while True:\n    pass", "timeout"),
        "fork_bomb": ("import os\nwhile True:\n    os.fork()", "sandbox_violation"),
        "subprocess_bomb": ("import subprocess\nsubprocess.Popen(['sh', '-c', ':(){ :|:& };:'])",
                            "sandbox_violation"),
        "allocate_50gb": ("x = bytearray(50 * 1024 ** 3)", "sandbox_violation"),
        "grow_memory": ("a = []\nwhile True:\n    a.append(bytearray(1 << 26))", "sandbox_violation"),
        "write_outside": (f"open({outside!r}, 'w').write('pwned')", "sandbox_violation"),
        "tcp_connect": (f"import socket\nsocket.create_connection(('127.0.0.1', {port})).sendall(b'hi')",
                        "sandbox_violation"),
        "print_1gb": ("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)",
                      "sandbox_violation"),
        "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "sandbox_violation"),
        "env_secret": ("import os\nprint(os.environ.get('RP_TEST_SECRET', 'absent'))", "wrong_answer"),
        "parent_environ": ("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", "sandbox_violation"),
        "big_file": ("f = open('big.bin', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))", "sandbox_violation"),
        "crash": ("raise RuntimeError('boom')", "crash"),
    }


def test_hostile_programs_fail_safely_while_pool_serves(pool, listener, tmp_path):
    outside = str(tmp_path / "outside.txt")
    port = listener.getsockname()[1]
    before = pool.stats()
    futures = {}
    for name, (source, _) in hostile_programs(outside, port).items():
        tests = [{"stdin": "", "stdout": SECRET}] if name == "env_secret" else ECHO
        futures[name] = pool.submit("code", program(source), tests, key=name)
    # the pool keeps serving honest work while the hostile samples run
    honest = pool.submit("code", program("print(int(input()) * 2)"), ECHO, key="honest")
    assert honest.result(timeout=60).reason == "ok"

    for name, (_, reason) in hostile_programs(outside, port).items():
        score = futures[name].result(timeout=60)
        assert (score.reason, score.reward, score.correct) == (reason, 0.0, False), (name, score)
        assert score.seconds <= T_MAX + 2, (name, score)  # time on a worker, queueing excluded

    # the host is unaffected: nothing written, no connection, the same workers, no leftovers
    assert not os.path.exists(outside)
    with pytest.raises(socket.timeout):
        listener.accept()
    after = pool.stats()
    assert after.worker_pids == before.worker_pids and after.workers_replaced == 0
    assert after.workers_alive == 2
    for pid in after.worker_pids:
        assert psutil.Process(pid).children(recursive=True) == []
    assert pool.submit("code", program("print(int(input()) * 2)"), ECHO).result(timeout=T_MAX + 2).correct


def test_env_secret_is_not_inherited_but_worker_has_it(pool):
    """The control for env_secret above: the secret really is in the workers' environment."""
    pid = pool.stats().worker_pids[0]
    assert SECRET in open(f"/proc/{pid}/environ").read()
    score = pool.submit("code", program("import os\nprint(sorted(os.environ))"),
                        [{"stdin": "", "stdout": "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']"}]).result(timeout=10)
    assert score.reason == "ok", score


def test_program_may_use_its_own_directory_and_stdlib(pool):
    source = ("import collections, heapq, gc\ngc.disable()\nopen('scratch.txt', 'w').write(input())\n"
              "print(open('scratch.txt').read()[::-1])")
    assert pool.submit("code", program(source), [{"stdin": "abc\n", "stdout": "cba"}]).result(timeout=10).correct


def test_killing_the_parent_through_a_pidfd_fails_and_the_pool_recovers(pool):
    """pidfd_open raises no audit event, so this gets past the hook.  As root the program sits
    in its own PID namespace and cannot reach the worker; as a plain user it may kill it, and
    the pool replaces the worker and retries.  Either way: a crash score, a full pool."""
    source = "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(int(input())), signal.SIGKILL)"
    pid = pool.stats().worker_pids[0]
    tests = [{"stdin": f"{pid}\n", "stdout": ""}]
    scores = [pool.submit("code", program(source), tests).result(timeout=60) for _ in range(2)]
    assert all((s.reason, s.reward) == ("crash", 0.0) for s in scores), scores
    assert pool.wait_ready(60) and pool.stats().workers_alive == 2
    if os.geteuid() == 0:
        assert pid in pool.stats().worker_pids
