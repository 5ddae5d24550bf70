"""Hostile programs through the real pool: each is scored as a failure with the right reason by
the sandbox itself (the pool's watchdog, which replaces a worker still busy T_max + worker_grace
after it took the sample, never fires), the pool keeps serving, and the host is unaffected.

As root (as in CI) every program runs as an unprivileged uid; the tests below the pool's also run
programs with the audit hook removed, to show the kernel's limits hold on their own, and check
that code is refused, never run as root, where no unprivileged uid can be arranged."""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from rollpacker.reward import RewardConfig, RewardPool, sandbox
from rollpacker.reward.sandbox import RUN_OK, SandboxLimits, SandboxUnavailable

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
        print(f"{name}: {score.reason} after {score.seconds:.2f} s on a worker ({score.detail})")
        assert (score.reason, score.reward, score.correct) == (reason, 0.0, False), (name, score)

    # the host is unaffected: nothing written, no connection, the same workers, no leftovers
    assert not os.path.exists(outside)
    with pytest.raises(socket.timeout):
        listener.accept()
    after = pool.stats()
    # no worker outlived its sample's budget (T_MAX + worker_grace): none replaced, no sample retried
    assert after.worker_pids == before.worker_pids and after.workers_replaced == 0 and after.retried == before.retried
    assert after.workers_alive == 2
    for pid in after.worker_pids:
        assert psutil.Process(pid).children(recursive=True) == []
    assert pool.submit("code", program("print(int(input()) * 2)"), ECHO).result(timeout=60).correct


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


def test_programs_never_run_as_root(pool):
    score = pool.submit("code", program("import os\nprint(0 in os.getresuid() + os.getresgid())"),
                        [{"stdin": "", "stdout": "False"}]).result(timeout=10)
    assert score.reason == "ok", score


def test_killing_the_parent_through_a_pidfd_fails_and_the_pool_recovers(pool):
    """pidfd_open raises no audit event, so this gets past the hook.  As root the program runs as
    another uid and may not signal the worker; as a plain user it may kill it, and the pool
    replaces the worker and retries.  Either way: a crash score, a full pool."""
    source = "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(int(input())), signal.SIGKILL)"
    pid = pool.stats().worker_pids[0]
    tests = [{"stdin": f"{pid}\n", "stdout": ""}]
    scores = [pool.submit("code", program(source), tests).result(timeout=60) for _ in range(2)]
    assert all((s.reason, s.reward) == ("crash", 0.0) for s in scores), scores
    assert pool.wait_ready(60) and pool.stats().workers_alive == 2
    if os.geteuid() == 0:
        assert pid in pool.stats().worker_pids


# ---- the kernel's limits alone: programs run with the audit hook removed -------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid-drop path is the root path (CI runs as root)")
UNHOOKED_UID = 61900  # unused by anything else, and apart from the pool's 61000 + i
HOOKLESS_BOOT = "exec(compile(open('solution.py').read(), 'solution.py', 'exec'), {'__name__': '__main__'})"


@pytest.fixture
def unhooked(monkeypatch):
    """Limits for programs that got past the audit hook: sandbox_boot is replaced by a bare exec."""
    monkeypatch.setattr(sandbox, "_BOOT_SOURCE", HOOKLESS_BOOT)
    limits = sandbox.resolve_isolation(SandboxLimits(uid=UNHOOKED_UID, max_processes=8, memory_mb=256))
    assert limits.refusal is None, limits.refusal
    return limits


def run_unhooked(source: str, limits: SandboxLimits, stdin: str = "") -> dict:
    run = sandbox.run_python(source, stdin, 10.0, limits)
    assert run.status == RUN_OK, run
    return json.loads(run.stdout)


def processes_of(uid: int) -> list[psutil.Process]:
    """Zombies included: unreaped, they would still count against the uid's process limit."""
    return [proc for proc in psutil.process_iter(["uids"]) if proc.info["uids"] and proc.info["uids"].real == uid]


@needs_root
def test_unhooked_program_runs_unprivileged_and_sees_only_the_interpreter(unhooked):
    covers = sandbox._covers([(root, False) for root in sandbox._interpreter_roots()], UNHOOKED_UID)
    expected = {cover: sorted({os.path.relpath(path, cover).split("/")[0] for path, _ in exposed})
                for cover, exposed in covers.items()}
    source = ("import json, os, sys\n"
              "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
              "print(json.dumps({'ids': os.getresuid() + os.getresgid(), 'groups': os.getgroups(),\n"
              "    'no_new_privs': status['NoNewPrivs'].strip(),\n"
              "    'parent_visible': os.path.exists(f'/proc/{os.getppid()}'),\n"
              "    'covers': {c: sorted(os.listdir(c)) for c in json.loads(input())}, 'prefix': sys.prefix}))")
    out = run_unhooked(source, unhooked, json.dumps(list(expected)))
    assert out["ids"] == [UNHOOKED_UID] * 6 and out["groups"] == [] and out["no_new_privs"] == "1"
    assert not out["parent_visible"]  # a /proc of its own: the root worker cannot be seen
    # the private ancestors of the installation (e.g. /root) show only the way to it
    assert out["covers"] == expected
    assert out["prefix"] == os.path.realpath(sys.base_prefix)


@needs_root
def test_unhooked_fork_bomb_is_contained_by_the_uid_process_limit(unhooked):
    """Children leave the session (so the group kill misses them) and would sleep for a minute:
    the kernel stops the bomb at the uid's process limit (the program then reports and exits on its
    own, before its 10 s timeout: RUN_OK) and the leftovers are killed and reaped."""
    source = ("import json, os, time\ncount = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
              "            os.setsid()\n            null = os.open('/dev/null', os.O_RDWR)\n"
              "            os.dup2(null, 1)\n            os.dup2(null, 2)\n            time.sleep(60)\n"
              "            os._exit(0)\n        count += 1\nexcept OSError as exc:\n"
              "    print(json.dumps({'forked': count, 'errno': exc.errno}))")
    out = run_unhooked(source, unhooked)
    print(f"fork bomb: {out}")
    assert out["errno"] == errno.EAGAIN and 0 < out["forked"] < unhooked.max_processes, out
    assert processes_of(UNHOOKED_UID) == []  # killed and reaped before run_python returned
    flag = ctypes.c_int(-1)  # and this process is no longer a child subreaper
    assert sandbox._LIBC.prctl(sandbox._PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) == 0 and flag.value == 0


@needs_root
def test_unhooked_writes_outside_the_working_directory_fail_in_the_kernel(unhooked):
    base = tempfile.mkdtemp(prefix="rp-sandbox-test-")
    try:
        os.chmod(base, 0o755)  # searchable, not writable, by the sandbox uid
        owned = os.path.join(base, "owned.txt")
        with open(owned, "w") as f:
            f.write("original")
        os.chmod(owned, 0o644)
        shared = os.path.join(base, "shared")
        os.mkdir(shared)
        os.chmod(shared, 0o1777)  # world-writable, like /tmp
        private = os.path.join(base, "private")
        os.mkdir(private, 0o700)
        with open(os.path.join(private, "secret.txt"), "w") as f:
            f.write(SECRET)
        attempts = {
            "overwrite_root_file": f"os.open({owned!r}, os.O_WRONLY)",
            "create_in_root_dir": f"open({os.path.join(base, 'new.txt')!r}, 'w')",
            "create_in_world_writable_dir": f"open({os.path.join(shared, 'new.txt')!r}, 'w')",
            "read_private_file": f"open({os.path.join(private, 'secret.txt')!r}).read()",
            "write_into_interpreter": "open(os.path.join(os.path.dirname(os.__file__), 'pwned.py'), 'w')",
            "own_directory": "open('scratch.txt', 'w').write('fine')",
        }
        source = "import json, os\nout = {}\n" + "".join(
            f"try:\n    {code}\n    out[{name!r}] = 'allowed'\nexcept OSError as exc:\n"
            f"    out[{name!r}] = errno.errorcode[exc.errno]\n" for name, code in attempts.items())
        out = run_unhooked("import errno\n" + source + "print(json.dumps(out))", unhooked)
        assert out.pop("own_directory") == "allowed"
        assert out.pop("overwrite_root_file") == "EACCES"  # the uid, not only the read-only mounts
        assert out.pop("read_private_file") == "EACCES"
        assert all(result in ("EACCES", "EROFS") for result in out.values()), out
        assert sorted(os.listdir(base)) == ["owned.txt", "private", "shared"] and os.listdir(shared) == []
        assert open(owned).read() == "original"
    finally:
        shutil.rmtree(base)


# ---- refusal: never run as root ------------------------------------------------------------------

def test_covers_are_the_topmost_ancestors_the_uid_cannot_search():
    """Built in a directory of the test's own that the uid can search: under pytest's temp root,
    private (0700) as root, that root would be every path's cover and hide the rule checked here."""
    uid = 61901
    base = Path(tempfile.mkdtemp(prefix="rp-covers-"))
    try:
        base.chmod(0o755)
        blocked = [p for p in [*reversed(list(base.parents)[:-1]), base] if not sandbox._searchable(str(p), uid)]
        if blocked:  # e.g. a TMPDIR under a private home directory
            assert os.environ.get("CI") != "true", f"CI must run this check: uid {uid} cannot search {blocked[0]}"
            pytest.skip(f"uid {uid} cannot search {blocked[0]}, an ancestor of the temp dir: set TMPDIR elsewhere")
        top = base / "top"
        (top / "open" / "closed" / "prefix").mkdir(parents=True)
        (top / "other").mkdir()
        for path, mode in ((top, 0o700), (top / "open", 0o755), (top / "open" / "closed", 0o700)):
            path.chmod(mode)
        prefix, other = str(top / "open" / "closed" / "prefix"), str(top / "other")
        covers = sandbox._covers([(prefix, False), (other, True)], uid)
        print(f"covers under {base}: {covers}")
        assert covers == {str(top): [(prefix, False), (other, True)]}
        assert sandbox._covers([(str(base), False)], uid) == {}  # reachable: nothing to mount
    finally:
        shutil.rmtree(base)


@needs_root
def test_root_without_a_sandbox_uid_refuses_to_run_code():
    ran = os.path.join(tempfile.gettempdir(), f"rp-sandbox-ran-{os.getpid()}")
    source = f"open({ran!r}, 'w')"
    with pytest.raises(SandboxUnavailable, match="refusing to run untrusted code as root"):
        sandbox.run_python(source, "", 5.0, SandboxLimits(uid=None))
    limits = sandbox.resolve_isolation(SandboxLimits(uid=None))
    assert limits.refusal == sandbox.ROOT_WITHOUT_UID
    with pytest.raises(SandboxUnavailable):
        sandbox.run_python(source, "", 5.0, limits)
    assert not os.path.exists(ran)


@needs_root
def test_root_that_cannot_isolate_refuses_instead_of_running_as_root(monkeypatch):
    """E.g. no mount namespaces: the probe fails once and every program is then refused."""
    def no_namespaces(workdir, covers):
        raise PermissionError(errno.EPERM, "unshare(CLONE_NEWNS): Operation not permitted")

    monkeypatch.setattr(sandbox, "_isolate_filesystem", no_namespaces)
    limits = sandbox.resolve_isolation(SandboxLimits(uid=UNHOOKED_UID))
    assert limits.refusal and "never run as root" in limits.refusal
    with pytest.raises(SandboxUnavailable, match="cannot be started as uid"):
        sandbox.run_python("print(1)", "", 5.0, limits)


@needs_root
def test_pool_without_a_sandbox_uid_scores_code_as_an_error_and_math_as_usual():
    cfg = RewardConfig(num_workers=1, code_t_min=1.0, code_t_max=T_MAX, sandbox_uid=None, start_method="spawn")
    with RewardPool(cfg) as p:
        assert p.wait_ready(60)
        code = p.submit("code", program("print(int(input()) * 2)"), ECHO).result(timeout=30)
        assert (code.reason, code.reward) == ("error", 0.0) and "as root" in code.detail, code
        assert p.submit("math", "\\boxed{2}", "2").result(timeout=30).correct
