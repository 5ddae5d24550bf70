"""SGLang rollout backend: the ``RolloutEngine`` interface over ``sglang.Engine`` (0.5.23, the pin, or
0.5.17; what differs between them is ``sglang_api.SURFACES``).

The first rank of each rollout TP group leads one sglang engine with ``tp_size`` = the group size
and ``base_gpu_id`` = that rank's local GPU; sglang starts its own TP worker processes on the
group's GPUs, so the other ranks of the group have nothing to drive. Each engine owns a block of
ports chosen by (node-local rank, TP size), so that no two engines on a node share one, whichever
TP sets a rank leads (``engine_ports``). On a GPU the engine host gets ``sglang_args.GPU_ENGINE_ENV``
(what the user set is kept); with ``device="cpu"`` the engine runs sglang's plain-torch CPU path
(``sglang_args.server_args``, ``cpu_engine_env``).

Each engine lives in an engine host process of its own (``sglang_host``: one sglang config per
process, sglang's signal handlers and its shutdown's process killing kept out of the rank). The
leader starts it in a new session, talks to it over a Unix socket (request plane and control plane
are calls on ``SGLangDriver`` there), and kills its process group when done. If the host or one of
sglang's processes dies, the next call raises ``EngineDiedError`` instead of waiting.

Weights are pushed inside one ``begin_weight_update()`` / ``end_weight_update()`` session where the
release has one (0.5.23 refuses ``update_weights_from_tensor`` outside it; 0.5.17 has no session and
loads each push at once: ``SGLangSurface.weight_session``). sglang answers a push, and a session
call, with ``(success, message)`` only, so every such return is checked and a refusal raises
``WeightSyncError``. On 0.5.17 the last push (the one that flushes the cache) waits for an idle
engine, since its scheduler asserts that flush (``SGLangSurface.flush_needs_idle``). Buckets travel
to the host as CUDA IPC handles on a GPU, by value on CPU.

Memory is released or resumed only on an idle engine: sglang's scheduler asserts ``is_fully_idle()``
in ``release_memory_occupation`` and SIGQUITs its parent if it is not, and an aborted request
stays in its running batch until the next forward. So ``release_memory``/``resume_memory`` first
wait (bounded by ``drain_timeout_s``) until every request sent to sglang, aborted ones included,
has come back and the scheduler's load snapshot shows nothing running or waiting.

``stats()`` reports the engine's own numbers: KV capacity is the scheduler's
``max_total_num_tokens`` (from ``get_server_info``); running, waiting and KV tokens in use come
from the load snapshot the scheduler publishes (``TokenizerManager.get_loads``), refreshed at
every prefill, every ``load_snapshot_publish_interval`` (15) decode steps, and when it goes idle.

Seeds: sglang (0.5.17 and 0.5.23) reads ``sampling_seed`` only when ``enable_deterministic_inference``
is on (``sampling/sampling_batch_info.py``, ``SamplingBatchInfo.from_schedule_batch``: the seed tensor
is built ``if enable_deterministic`` and is None otherwise), and ``server_args`` does not turn it
on (with it, the flashinfer sampler asserts on any top-p/top-k request, ``layers/sampler.py``).
So a request's seed is passed through but guarantees nothing here: the same seeded request can
give a different sample on a rerun, after a migration or on another engine. Only greedy
(temperature 0) output is reproducible, up to batch-dependent numerics.

Semantics matched to the reference engine:
- log-probs are of the temperature-1 model distribution
  (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, inherited by SGLang's subprocesses);
- a request with no stop ids runs to ``max_new_tokens`` (``ignore_eos``);
  SGLang otherwise also stops at the model's EOS, which callers pass as a stop id;
- output tokens and log-probs both come from ``output_token_logprobs``, so they
  are aligned by construction; preemptions are SGLang's ``num_retractions``;
- with ``return_routing`` on a MoE model, ``routed_experts`` is sglang's routing of every fed
  position, translated by ``sglang_routing`` (which says where it departs from the reference engine).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from multiprocessing.connection import Client, wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

import rollpacker
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import MEMORY_TAGS, Completion, EngineStats, GenerationRequest, RolloutEngine
from rollpacker.rollout.sglang_api import AGENT_STORE_ENV, SGLANG_ENV
from rollpacker.rollout.sglang_args import cpu_engine_env, gpu_engine_env, server_args
from rollpacker.rollout.sglang_host import DOORBELL_ENV, KEY_ENV, LOG_LEVEL_ENV, PARENT_ENV

START_TIMEOUT_S = 900.0  # an engine host's start: sglang loads the model and sizes its KV pool
CONNECT_TIMEOUT_S = 120.0  # the host's Python start-up, up to its listening socket


class EngineDiedError(RuntimeError):
    """The engine host process, or one of sglang's processes under it, is gone."""


def weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   limit_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``limit_bytes`` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """A weight bucket for the engine host. CUDA tensors go as IPC handles (torch's multiprocessing
    pickler): the host maps the rank's memory, nothing is copied through a socket. CPU tensors go by
    value: torch's CPU sharing passes file descriptors through multiprocessing's resource sharer,
    which only a process that multiprocessing itself started can reach."""
    if any(t.is_cuda for _, t in bucket):
        return bytes(ForkingPickler.dumps(bucket))
    return pickle.dumps(bucket, protocol=pickle.HIGHEST_PROTOCOL)


def host_env(extra: dict[str, str]) -> dict[str, str]:
    """The engine host's environment: the rank's, with ``SGLANG_ENV`` and ``extra`` (``cpu_engine_env``
    or ``gpu_engine_env``) set and ``TORCHELASTIC_USE_AGENT_STORE`` removed (the engines would
    otherwise wait on torchrun's agent store).

    torchrun's c10d rendezvous sets that variable to True in every worker. sglang's schedulers would
    inherit it, and their ``init_process_group("tcp://127.0.0.1:<nccl_port>")`` then only creates
    ``TCPStore`` clients (``torch/distributed/rendezvous.py``, ``_create_c10d_store``): nobody serves
    the port, so they wait for the store until its timeout and the engine never starts. Neither
    supported sglang release touches the variable. The rank keeps it: its own process groups rely on it.
    """
    env = {k: v for k, v in os.environ.items() if k != AGENT_STORE_ENV}
    env.update(SGLANG_ENV)
    env.update(extra)
    package_root = str(Path(rollpacker.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _vocab_size(model_dir: str | Path) -> int | None:
    """The checkpoint's ``vocab_size`` (its ``config.json``), or None where there is none to read."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError):
        return None


class _ProcessHost:
    """One engine host process (``sglang_host``) and the connection to it."""

    def __init__(self, kwargs: dict[str, Any], cfg: RolloutConfig, engine_id: int, vocab_size: int | None,
                 env: dict[str, str]):
        self.engine_id = engine_id
        self._dir = tempfile.mkdtemp(prefix=f"rollpacker-sglang-{engine_id}-")
        address, key = os.path.join(self._dir, "host.sock"), os.urandom(32)
        # the host writes a byte here per result: the rank sleeps on it rather than polling the host
        self.doorbell, ring = os.pipe()
        os.set_blocking(self.doorbell, False)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "rollpacker.rollout.sglang_host", address],
                                         env={**env, KEY_ENV: key.hex(), PARENT_ENV: str(os.getpid()),
                                              DOORBELL_ENV: str(ring)},
                                         start_new_session=True, pass_fds=(ring,))
        finally:
            os.close(ring)
        self._exited = os.pidfd_open(self.proc.pid)  # readable once the host has exited
        try:
            self.conn = self._connect(address, key)
            self.conn.send({"kwargs": kwargs, "cfg": cfg, "engine_id": engine_id, "vocab_size": vocab_size})
            info = self._reply("start", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.kv_capacity, self.pid, self.sglang_version = info["kv_capacity"], info["pid"], info["sglang"]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "poll":  # before the call: a ring after it is for what the next poll returns
            with contextlib.suppress(BlockingIOError):
                os.read(self.doorbell, 1 << 16)
        try:
            self.conn.send((method, args, kwargs))
        except OSError as exc:
            raise self._died(method) from exc
        return self._reply(method, None)

    def close(self) -> None:
        """Kill the host's process group (the host and sglang's processes: nothing of the rank's)."""
        with contextlib.suppress(AttributeError, OSError):
            self.conn.close()
        if self.doorbell >= 0:  # once: a second close could hit a file that took its number
            os.close(self.doorbell)
            os.close(self._exited)
            self.doorbell = -1
        if self.proc.returncode is None:  # not reaped yet: its pid still names its group alone
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _connect(self, address: str, key: bytes):
        """Connect once the host rings its doorbell (it listens then), or say why it never did."""
        if self.doorbell not in wait([self.doorbell, self._exited], CONNECT_TIMEOUT_S):
            if self._exit_status() is not None:
                raise self._died("start")
            raise TimeoutError(f"engine {self.engine_id}: its host process {self.proc.pid} did not listen within "
                               f"{CONNECT_TIMEOUT_S}s")
        os.read(self.doorbell, 1)
        return Client(address, family="AF_UNIX", authkey=key)

    def _reply(self, method: str, timeout_s: float | None) -> Any:
        """The host's answer; its exit ends the wait as an answer would (a reply it sent first is read)."""
        if self.conn not in wait([self.conn, self._exited], timeout_s):
            if self._exit_status() is not None:
                raise self._died(method)
            raise TimeoutError(f"engine {self.engine_id}: no answer to {method} within {timeout_s}s")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            raise self._died(method) from None
        if status == "error":
            raise value
        return value

    def _exit_status(self) -> int | None:
        """The host's exit code (negative: the signal), None while it runs. It is not reaped here:
        until ``close`` reaps it, its pid, the id of its process group, cannot name another group."""
        info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def _died(self, method: str) -> EngineDiedError:
        wait([self._exited], 5)  # its connection may close a moment before it exits
        code = self._exit_status()
        return EngineDiedError(f"engine {self.engine_id}: its sglang host process {self.proc.pid} is gone "
                               f"(exit code {code}) during {method}; its output above says why")


class SGLangEngine(RolloutEngine):
    """``RolloutEngine`` over an sglang engine in its own host process; constructed on every rank of
    ``group``. ``device`` ``"cuda:N"`` pins the leader's GPU, ``"cuda"`` takes ``LOCAL_RANK``'s;
    ``"cpu"`` runs the engine on CPU (``sglang_args.server_args``). ``dtype`` overrides the dtype it
    computes in (sglang's names: "float32", "bfloat16"). ``host`` makes what runs the engine's driver
    from (sglang's engine arguments, ``cfg``, ``engine_id``, the model's vocabulary size); by default
    a process of its own, which reads the installed sglang release. ``ep``: a MoE model's experts in
    this many blocks over the group's ranks (sglang's ``ep_size``).
    """

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, group: dist.ProcessGroup | None = None,
                 engine_id: int = 0, device: str = "cuda", dtype: str | None = None,
                 host: Callable[..., Any] | None = None, ep: int = 1):
        cfg.validate()
        self.cfg, self.engine_id = cfg, engine_id
        if group is None:
            ranks = [dist.get_rank() if dist.is_initialized() else 0]
        else:
            ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"engine {engine_id}: an SGLang TP group must be consecutive ranks on one node "
                             f"(its GPUs are base_gpu_id..base_gpu_id+tp-1), got ranks {ranks}")
        self.is_leader = group is None or dist.get_rank(group) == 0
        self._host: _ProcessHost | None = None
        if not self.is_leader:
            return
        dev = torch.device(device)
        local_rank = int(os.environ.get("LOCAL_RANK", ranks[0]))
        gpu = None if dev.type == "cpu" else dev.index if dev.index is not None else local_rank
        kwargs = server_args(model_dir, cfg, tp_size=len(ranks), local_rank=local_rank, gpu_id=gpu,
                             engine_id=engine_id, device=dev, dtype=dtype, ep_size=ep)
        vocab_size = _vocab_size(model_dir)
        if host is not None:
            self._host = host(kwargs, cfg, engine_id, vocab_size)
        else:
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            extra = cpu_engine_env(len(ranks), local_rank, local_ranks) if dev.type == "cpu" else gpu_engine_env()
            env = {**host_env(extra),
                   LOG_LEVEL_ENV: str(logging.getLogger().getEffectiveLevel())}
            self._host = _ProcessHost(kwargs, cfg, engine_id, vocab_size, env)

    @property
    def host_pid(self) -> int | None:
        """The engine host's process id on the leader (this process's for a double), else None."""
        return self._host.pid if self._host else None

    @property
    def sglang_version(self) -> str | None:
        """The sglang release the leader's engine runs (its double's for a double), else None."""
        return self._host.sglang_version if self._host else None

    # ---- interface -----------------------------------------------------------------------------
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._leader("submit", list(requests))

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """Wait up to ``timeout`` (None: until one finishes) for a completion, then drain the rest."""
        return self._leader("poll", timeout)

    def ready_fd(self) -> int | None:
        """The host's doorbell: a byte per result (an in-process double has none)."""
        return getattr(self._host, "doorbell", None)

    def abort(self, request_ids: Iterable[str]) -> None:
        self._leader("abort", list(request_ids))

    def progress(self, request_ids: Sequence[str]) -> list[int]:
        return self._leader("progress", list(request_ids))

    def abort_all(self) -> None:
        self._leader("abort_all")

    def evict(self, request_ids: Iterable[str], timeout_s: float = 60.0) -> list[Completion]:
        """Abort the requests and collect what SGLang returns for each: the output so far
        (finish reason "evicted"), or the whole output of one that finished meanwhile."""
        return self._leader("evict", list(request_ids), timeout_s)

    def active_request_ids(self) -> list[str]:
        return self._leader("active_request_ids")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push full HF tensors in buckets of at most ``weight_bucket_mb``, inside one weight-update
        session; the last bucket flushes the cache. Raises ``WeightSyncError`` if SGLang refuses any step.

        Other ranks of the group own no engine: their call only walks the tensors."""
        if not self.is_leader:
            for _ in named_tensors:
                pass
            return
        self._host.call("begin_weights")
        try:
            pending = None
            for bucket in weight_buckets(named_tensors, self.cfg.weight_bucket_mb << 20):
                if pending is not None:
                    self._host.call("push", pack_bucket(pending), False)
                pending = bucket
            if pending is not None:
                self._host.call("push", pack_bucket(pending), True)
        except BaseException:
            with contextlib.suppress(Exception):
                self._host.call("close_weights")
            raise
        self._host.call("end_weights")

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Release once the engine is idle (aborted requests drained); the leader's engine releases
        the whole group's devices."""
        if self.is_leader:
            self._host.call("release_memory", list(tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        if self.is_leader:
            self._host.call("resume_memory", list(tags))

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until sglang holds none of our requests (see ``SGLangDriver.wait_idle``)."""
        self._leader("wait_idle", timeout_s)

    def stats(self) -> EngineStats:
        """The engine's own load (running, waiting, KV tokens in use, of ``max_total_num_tokens``);
        preemptions = retractions. ``extra["in_flight"]`` counts requests not yet returned to us."""
        if not self.is_leader:
            return EngineStats(extra={"backend": "sglang"})
        return self._host.call("stats")

    def shutdown(self) -> None:
        if self._host is None:
            return
        try:
            with contextlib.suppress(EngineDiedError):
                self._host.call("shutdown")
        finally:
            self._host.close()
            self._host = None

    def serve_follower(self) -> str:
        """Nothing to mirror: SGLang drives the group's GPUs from the leader's engine."""
        return "stop"

    # ---- internals -----------------------------------------------------------------------------
    def _leader(self, method: str, *args: Any) -> Any:
        if not self.is_leader:
            raise RuntimeError("engine methods are called on the TP group's leader")
        if self._host is None:
            raise RuntimeError(f"engine {self.engine_id} has been shut down")
        return self._host.call(method, *args)
