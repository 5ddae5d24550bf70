"""SGLang backend: its logic against recording doubles of each supported sglang release, in this process.
Real engine hosts, and each release's surface (``sglang_api.SURFACES``) against the source of that
release's wheel (downloaded by pip on first use): tests/integration/test_sglang_backend_procs.py."""
from __future__ import annotations

import asyncio
import functools
import os
import pickle
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from rollpacker.rollout import make_engine
from rollpacker.configlib import ConfigError
from rollpacker.rollout.config import RENDEZVOUS_PORTS, SGLANG_PORT_SPAN, RolloutConfig
from rollpacker.rollout.engine import FINISH_EVICTED, GenerationRequest, RequestError, SamplingParams
from rollpacker.rollout.sglang_args import engine_ports, server_args
from rollpacker.rollout.sglang_api import (AGENT_STORE_ENV, SGLANG_PIN, SGLANG_SAMPLING_KEYS, WeightSyncError,
                                           check_call, sampling_params, surface_for)
from rollpacker.rollout.sglang_backend import SGLangEngine, host_env, weight_buckets
from rollpacker.rollout.sglang_host import SGLangDriver

HOLD = 10_000  # a request with this max_new_tokens never finishes in the double unless aborted


class RecordingTokenizerManager:
    def __init__(self, engine: "RecordingEngine"):
        self.engine = engine
        self.waiting: dict[str, asyncio.Event] = {}

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.engine.calls.append(("abort_request", dict(rid=rid, abort_all=abort_all)))
        for key, event in self.waiting.items():
            if (abort_all or key == rid) and key not in self.engine.ignore_aborts:
                event.set()

    async def get_loads(self):
        """One snapshot like sglang's scheduler publishes: here, exact and never stale."""
        running = sum(not e.is_set() for e in self.waiting.values())
        return [SimpleNamespace(num_running_reqs=running, num_waiting_reqs=0, num_used_tokens=7 * running)]


class RecordingEngine:
    """Stands in for ``sglang.Engine``: records calls, answers like SGLang with return_logprob=True.

    Like the real one, its synchronous methods drive ``self.loop`` with ``run_until_complete``,
    which fails if the backend left that loop running in its background thread.
    """

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple[str, dict]] = []
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = RecordingTokenizerManager(self)
        self.in_session = False
        self.refuse: set[str] = set()
        self.held: set[str] = set()  # requests sglang would still hold (aborted ones until they end)
        self.ignore_aborts: set[str] = set()  # requests an abort never ends
        self.env_at_start = dict(os.environ)  # what the engine's spawned processes would inherit

    def get_server_info(self):
        return {"max_total_num_tokens": 4096}

    async def async_generate(self, *, input_ids, sampling_params, return_logprob, rid):
        self.calls.append(("async_generate", dict(input_ids=input_ids, sampling_params=sampling_params,
                                                  return_logprob=return_logprob, rid=rid)))
        n = sampling_params["max_new_tokens"]
        if n >= HOLD:
            event = self.tokenizer_manager.waiting.setdefault(rid, asyncio.Event())
            self.held.add(rid)
            await event.wait()
            await asyncio.sleep(0.05)  # like sglang, an aborted request ends only after a later step
            self.held.discard(rid)
            return {"meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}
        await asyncio.sleep(0.001 * n)
        tokens = [(sum(input_ids) + i) % 97 for i in range(n)]
        stop = next((i for i, t in enumerate(tokens) if t in sampling_params["stop_token_ids"]), None)
        tokens = tokens if stop is None else tokens[:stop + 1]
        return {"output_ids": tokens, "meta_info": {
            "finish_reason": {"type": "length" if stop is None else "stop"},
            "output_token_logprobs": [(-0.1 * (t + 1), t, None) for t in tokens],
            "num_retractions": int(rid.removeprefix("retracted-")) if rid.startswith("retracted-") else 0}}

    def _sync(self, name: str, **kwargs):
        self.calls.append((name, kwargs))
        return self.loop.run_until_complete(asyncio.sleep(0))

    def release_memory_occupation(self, tags=None):
        # sglang's scheduler asserts is_fully_idle() here and SIGQUITs the rank
        assert not self.held, f"release_memory_occupation while sglang holds {sorted(self.held)}"
        return self._sync("release_memory_occupation", tags=tags)

    def resume_memory_occupation(self, tags=None):
        return self._sync("resume_memory_occupation", tags=tags)

    # Weight updates answer (success, message) like sglang 0.5.23, which refuses a push outside a
    # begin/end session; ``refuse`` names tensors whose push is refused anyway (a failing load).
    def begin_weight_update(self):
        self._sync("begin_weight_update")
        if self.in_session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.in_session = True
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        names = [n for n, _ in named_tensors]
        self._sync("update_weights_from_tensor", names=names, load_format=load_format, flush_cache=flush_cache)
        if not self.in_session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if self.refuse & set(names):
            return False, f"Failed to update weights: cannot load {sorted(self.refuse & set(names))}"
        return True, "Success"

    def end_weight_update(self):
        self._sync("end_weight_update")
        if not self.in_session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.in_session = False
        return True, "Success"

    def shutdown(self):
        self._sync("shutdown")


class NoSessionEngine(RecordingEngine):
    """Stands in for sglang 0.5.17: no weight-update session, a push loads at once, and a push that
    flushes the cache while requests are held kills the scheduler (``SGLangSurface.flush_needs_idle``)."""

    @property
    def begin_weight_update(self):
        raise AttributeError("sglang 0.5.17 has no begin_weight_update")

    @property
    def end_weight_update(self):
        raise AttributeError("sglang 0.5.17 has no end_weight_update")

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        names = [n for n, _ in named_tensors]
        self._sync("update_weights_from_tensor", names=names, load_format=load_format, flush_cache=flush_cache)
        assert not (flush_cache and self.held), f"the scheduler asserts the flush while holding {sorted(self.held)}"
        if self.refuse & set(names):
            return False, f"Failed to update weights: cannot load {sorted(self.refuse & set(names))}"
        return True, "Success"


class LocalHost:
    """An SGLang engine's driver in this process, over a double of ``sglang.Engine`` that stands for
    sglang ``version``: our translation logic without the real engine (which always gets a process
    of its own)."""

    def __init__(self, engine_cls, kwargs, cfg, engine_id, vocab_size, version):
        surface = surface_for(version)
        check_call(surface, "Engine.__init__", kwargs)
        self.driver = SGLangDriver(engine_cls(**kwargs), cfg, engine_id, surface, vocab_size)
        self.kv_capacity, self.pid, self.sglang_version = self.driver.kv_capacity, os.getpid(), version

    def call(self, method, *args, **kwargs):
        if method == "push":
            args = (pickle.loads(args[0]), *args[1:])
        return getattr(self.driver, method)(*args, **kwargs)

    def close(self):
        pass


def in_process(engine_cls, version=SGLANG_PIN):
    """``SGLangEngine``'s ``host``: the driver in this process, over ``engine_cls``."""
    return functools.partial(LocalHost, engine_cls, version=version)


def _engine(**cfg):
    return make_engine(RolloutConfig(backend="sglang", **cfg), "/models/qwen", engine_id=3, device="cuda:2",
                       sglang_host=in_process(RecordingEngine))


def double(engine) -> RecordingEngine:
    """The double behind an engine built with ``in_process`` (its driver runs in this process)."""
    return engine._host.driver.engine


def _drain(engine, timeout=5.0) -> dict:
    out = {}
    while engine.active_request_ids():
        got = engine.poll(timeout)
        assert got or engine.active_request_ids(), "poll timed out"
        out.update((c.request_id, c) for c in got)
    return out


def test_server_args_derive_ports_and_gpu_from_the_rank(monkeypatch):
    cfg = RolloutConfig(backend="sglang", sglang_base_port=31000, mem_fraction_static=0.6, seed=4)
    args = server_args("/m", cfg, tp_size=2, local_rank=5, gpu_id=1, engine_id=2)
    assert (args["port"], args["nccl_port"]) == engine_ports(31000, 5, 2)
    assert (args["tp_size"], args["base_gpu_id"], args["random_seed"]) == (2, 1, 6)
    assert args["enable_memory_saver"] is True and args["mem_fraction_static"] == 0.6
    engine = _engine()
    assert double(engine).kwargs["base_gpu_id"] == 2  # from device="cuda:2"
    monkeypatch.setenv("LOCAL_RANK", "3")
    by_local_rank = make_engine(RolloutConfig(backend="sglang"), "/m", device="cuda",
                                sglang_host=in_process(RecordingEngine))
    assert double(by_local_rank).kwargs["base_gpu_id"] == 3
    assert double(by_local_rank).kwargs["port"] == engine_ports(30000, 3, 1)[0]


def test_server_args_on_cpu_are_sglangs_plain_torch_path():
    """device "cpu": torch-native attention and sampling, no CUDA graphs, no memory saver (CUDA-only),
    no GPU index, fp32 unless a dtype is named, and the KV pool is ``kv_cache_tokens``."""
    cfg = RolloutConfig(backend="sglang", kv_cache_tokens=4096, seed=1)
    args = server_args("/m", cfg, tp_size=1, local_rank=0, engine_id=2, device="cpu")
    assert {k: args[k] for k in ("device", "attention_backend", "sampling_backend", "disable_cuda_graph",
                                 "enable_memory_saver", "max_total_tokens", "dtype", "random_seed")} == dict(
        device="cpu", attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
        enable_memory_saver=False, max_total_tokens=4096, dtype="float32", random_seed=3)
    assert "base_gpu_id" not in args
    assert server_args("/m", cfg, tp_size=1, local_rank=0, engine_id=0, device="cpu", dtype="bfloat16")["dtype"] \
        == "bfloat16"
    gpu = server_args("/m", cfg, tp_size=1, local_rank=0, gpu_id=0, engine_id=0)
    assert "device" not in gpu and "max_total_tokens" not in gpu and "dtype" not in gpu
    on_cpu = make_engine(RolloutConfig(backend="sglang"), "/m", device="cpu", sglang_host=in_process(RecordingEngine))
    assert double(on_cpu).kwargs["device"] == "cpu" and "base_gpu_id" not in double(on_cpu).kwargs
    with pytest.raises(ValueError, match="cuda or cpu"):
        server_args("/m", cfg, tp_size=1, local_rank=0, engine_id=0, device="meta")


def test_gpu_engine_kernels_come_from_the_config_and_its_env_keeps_the_users_values(monkeypatch):
    """On a GPU the engine gets the config's attention and sampling backends (the carried 0.5.17's
    triton / pytorch by default; None or "auto" leave sglang's own choice), and its host the GPU
    engine environment, less any variable the user set; a CPU engine keeps its plain-torch kernels."""
    from rollpacker.rollout.sglang_args import GPU_ENGINE_ENV, gpu_engine_env

    gpu = server_args("/m", RolloutConfig(backend="sglang"), tp_size=1, local_rank=0, gpu_id=0, engine_id=0)
    assert (gpu["attention_backend"], gpu["sampling_backend"]) == ("triton", "pytorch")
    own = RolloutConfig(backend="sglang", sglang_attention_backend=None, sglang_sampling_backend="auto")
    gpu = server_args("/m", own, tp_size=1, local_rank=0, gpu_id=0, engine_id=0)
    assert "attention_backend" not in gpu and "sampling_backend" not in gpu
    cpu = server_args("/m", own, tp_size=1, local_rank=0, engine_id=0, device="cpu")
    assert (cpu["attention_backend"], cpu["sampling_backend"]) == ("torch_native", "pytorch")
    with pytest.raises(ConfigError, match="sglang_sampling_backend"):
        RolloutConfig(backend="sglang", sglang_sampling_backend="").validate()
    for key in GPU_ENGINE_ENV:
        monkeypatch.delenv(key, raising=False)
    assert gpu_engine_env() == GPU_ENGINE_ENV == {"SGLANG_IS_FLASHINFER_AVAILABLE": "false",
                                                  "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1", "TRITON_F32_DEFAULT": "ieee"}
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    assert "TRITON_F32_DEFAULT" not in gpu_engine_env()
    assert host_env(gpu_engine_env())["TRITON_F32_DEFAULT"] == "tf32"
    assert "enable_deterministic_inference" not in gpu
    det = RolloutConfig(backend="sglang", sglang_deterministic_inference=True)
    assert server_args("/m", det, tp_size=1, local_rank=0, gpu_id=0, engine_id=0)["enable_deterministic_inference"]


def test_cpu_engine_env_splits_the_cpus_among_tp_ranks(monkeypatch):
    """sglang 0.5.23 on CPU gives each TP rank a NUMA node unless SGLANG_CPU_OMP_THREADS_BIND is set;
    set, each TP rank binds to the CPUs of its own node-local rank, so that the TP-1 engines of a
    node's ranks running at once do not spin on the same CPUs."""
    from rollpacker.rollout.sglang_args import THREADS_BIND_ENV, cpu_engine_env
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    assert cpu_engine_env(1, cpus=[0, 1]) == {THREADS_BIND_ENV: "0-1"}  # a lone engine: the process's CPUs
    assert cpu_engine_env(2, cpus=[0, 1, 2, 3]) == {THREADS_BIND_ENV: "0-1|2-3"}
    assert cpu_engine_env(2, cpus=[0, 4, 5]) == {THREADS_BIND_ENV: "0|4-5"}
    assert cpu_engine_env(2, cpus=[3]) == {THREADS_BIND_ENV: "3|3"}
    # two ranks on a 2-CPU node: a TP-1 engine each, then one TP-2 engine over both
    assert [cpu_engine_env(1, r, 2, cpus=[0, 1]) for r in (0, 1)] == [{THREADS_BIND_ENV: "0"}, {THREADS_BIND_ENV: "1"}]
    assert cpu_engine_env(2, 0, 2, cpus=[0, 1]) == {THREADS_BIND_ENV: "0|1"}
    # 8 ranks on 16 CPUs: rank 3's TP-1 engine, and the TP-4 engine of ranks 4-7
    assert cpu_engine_env(1, 3, 8, cpus=list(range(16))) == {THREADS_BIND_ENV: "6-7"}
    assert cpu_engine_env(4, 4, 8, cpus=list(range(16))) == {THREADS_BIND_ENV: "8-9|10-11|12-13|14-15"}
    monkeypatch.setenv(THREADS_BIND_ENV, "0-7|8-15")
    assert cpu_engine_env(2, cpus=[0, 1]) == {}


def test_engine_ports_never_collide_on_a_node_nor_reach_the_rendezvous_ports():
    """Every (local rank, TP, EP) engine of a node of up to 16 ranks gets its own ports, whatever
    layouts a rank leads, none in launch/train.sh's rendezvous range and all below 65536."""
    layouts = [(tp, ep) for tp in (1, 2, 4, 8, 16) for ep in (1, 2, 4, 8, 16) if ep <= tp]
    for base in (30000, 29000, 65536 - SGLANG_PORT_SPAN):
        RolloutConfig(backend="sglang", sglang_base_port=base).validate()
        ports = [p for rank in range(16) for tp, ep in layouts for p in engine_ports(base, rank, tp, ep)]
        assert len(set(ports)) == len(ports) == 16 * 15 * 2
        assert all(p not in RENDEZVOUS_PORTS and 1024 <= p < 65536 for p in ports)
        assert max(ports) < base + SGLANG_PORT_SPAN
    for bad in (28000, 20000 - SGLANG_PORT_SPAN + 1, 65536 - SGLANG_PORT_SPAN + 1, 1023):
        with pytest.raises(ConfigError, match="sglang"):
            RolloutConfig(backend="sglang", sglang_base_port=bad).validate()
    with pytest.raises(ValueError, match="power of two"):
        engine_ports(30000, 0, 3)
    with pytest.raises(ValueError, match="local rank 16"):
        engine_ports(30000, 16, 1)
    with pytest.raises(ValueError, match="EP size must be a power of two dividing the TP size 2, got 4"):
        engine_ports(30000, 0, 2, 4)


def test_an_engine_splits_experts_with_sglangs_ep_size_on_a_gpu_and_is_refused_on_cpu():
    cfg = RolloutConfig(backend="sglang")
    args = server_args("/m", cfg, tp_size=4, local_rank=0, gpu_id=0, engine_id=0, ep_size=2)
    assert (args["tp_size"], args["ep_size"]) == (4, 2)
    assert (args["port"], args["nccl_port"]) == engine_ports(cfg.sglang_base_port, 0, 4, 2) != engine_ports(
        cfg.sglang_base_port, 0, 4, 1)
    assert "ep_size" not in server_args("/m", cfg, tp_size=4, local_rank=0, gpu_id=0, engine_id=0)
    with pytest.raises(ValueError, match="fused_moe_native.py:77"):
        server_args("/m", cfg, tp_size=2, local_rank=0, engine_id=0, device="cpu", ep_size=2)


def test_engine_host_env_drops_torchruns_agent_store_flag_and_sets_sglangs(monkeypatch):
    """The engine host (and so sglang's schedulers) must not inherit TORCHELASTIC_USE_AGENT_STORE
    (it would make the engines wait on torchrun's agent store); the rank keeps it. The host also gets
    SGLANG_ENV and the CPU engine's variables."""
    monkeypatch.setenv(AGENT_STORE_ENV, "True")
    env = host_env({"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    assert AGENT_STORE_ENV not in env and os.environ[AGENT_STORE_ENV] == "True"
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1" and env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert str(Path(__file__).resolve().parents[2]) in env["PYTHONPATH"].split(os.pathsep)


def test_requests_translate_both_ways_and_complete():
    engine = _engine()
    reqs = [GenerationRequest("a", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=5)),
            GenerationRequest("b", [4, 5], SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=11,
                                                          max_new_tokens=30, stop_token_ids=(14,))),
            GenerationRequest("retracted-2", [7], SamplingParams(max_new_tokens=3)),
            GenerationRequest("retracted-3", [8], SamplingParams(max_new_tokens=2))]
    engine.submit(reqs)
    done = _drain(engine)
    assert done["a"].output_ids == [6, 7, 8, 9, 10] and done["a"].finish_reason == "length"
    assert done["a"].logprobs == pytest.approx([-0.7, -0.8, -0.9, -1.0, -1.1])
    assert done["b"].output_ids == [9, 10, 11, 12, 13, 14] and done["b"].finish_reason == "stop"
    assert done["a"].engine_id == 3
    sent = {c[1]["rid"]: c[1] for c in double(engine).calls if c[0] == "async_generate"}
    assert sent["a"]["return_logprob"] is True and sent["a"]["input_ids"] == [1, 2, 3]
    assert sent["a"]["sampling_params"] == dict(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=5,
                                                stop_token_ids=[], ignore_eos=True)
    assert sent["b"]["sampling_params"]["sampling_seed"] == 11 and not sent["b"]["sampling_params"]["ignore_eos"]
    # the engine's counts are summed over its requests (a request's rid names its retractions here);
    # the KV capacity is checked against the real engine's in tests/sglang_cpu/lifecycle_checks.py
    stats = engine.stats()
    assert stats.preemptions == 2 + 3 and stats.running == 0
    assert stats.tokens_generated == sum(len(c.output_ids) for c in done.values()) == 5 + 6 + 3 + 2
    for p in (reqs[0].params, reqs[1].params):
        assert set(sampling_params(p)) <= set(SGLANG_SAMPLING_KEYS)


def test_abort_reaches_the_tokenizer_manager_and_the_request_never_completes():
    engine = _engine()
    engine.submit([GenerationRequest("held", [1], SamplingParams(max_new_tokens=HOLD)),
                   GenerationRequest("held2", [1], SamplingParams(max_new_tokens=HOLD)),
                   GenerationRequest("short", [2], SamplingParams(max_new_tokens=2))])
    assert list(engine.poll(5.0))[0].request_id == "short"
    engine.abort(["held"])
    assert engine.active_request_ids() == ["held2"]
    engine.abort_all()
    assert engine.active_request_ids() == [] and engine.poll(0.2) == []
    aborts = [c[1] for c in double(engine).calls if c[0] == "abort_request"]
    assert aborts == [dict(rid="held", abort_all=False), dict(rid="", abort_all=True)]


def test_weights_are_pushed_in_bounded_buckets_and_the_last_flushes():
    mb = torch.zeros(1 << 18)  # 1 MiB of fp32
    named = [(f"w{i}", mb) for i in range(7)] + [("big", torch.zeros(5 << 18)), ("tail", mb)]
    assert [len(b) for b in weight_buckets(named, 3 << 20)] == [3, 3, 1, 1, 1]
    engine = _engine(weight_bucket_mb=3)
    engine.submit([GenerationRequest("x", [1], SamplingParams(max_new_tokens=1))])
    _drain(engine)  # the loop ran: the synchronous update must run while it is stopped
    engine.update_weights(iter(named))
    pushes = [c[1] for c in double(engine).calls if c[0] == "update_weights_from_tensor"]
    assert [p["names"] for p in pushes] == [["w0", "w1", "w2"], ["w3", "w4", "w5"], ["w6"], ["big"], ["tail"]]
    assert [p["flush_cache"] for p in pushes] == [False] * 4 + [True]
    session = [c[0] for c in double(engine).calls if "weight" in c[0]]
    assert session == ["begin_weight_update", *["update_weights_from_tensor"] * 5, "end_weight_update"]


def test_a_refused_weight_push_raises_naming_engine_and_tensors_and_closes_the_session():
    engine = _engine(weight_bucket_mb=1)
    mb = torch.zeros(1 << 18)
    double(engine).refuse = {"layers.1.w"}
    with pytest.raises(WeightSyncError, match=r"engine 3: .*update_weights_from_tensor.*'layers\.1\.w'.*cannot load"):
        engine.update_weights([("layers.0.w", mb), ("layers.1.w", mb), ("layers.2.w", mb)])
    calls = [c[0] for c in double(engine).calls if "weight" in c[0]]
    assert calls == ["begin_weight_update", "update_weights_from_tensor", "update_weights_from_tensor",
                     "end_weight_update"]  # stopped at the refusal, and the session was closed
    double(engine).refuse = set()
    engine.update_weights([("layers.0.w", mb)])  # a later sync opens a fresh session
    double(engine).in_session = True  # an engine whose session is stuck open refuses begin
    with pytest.raises(WeightSyncError, match="engine 3: .*begin_weight_update.*already open"):
        engine.update_weights([("layers.0.w", mb)])


def test_memory_release_and_resume_by_tag_need_an_idle_engine():
    engine = _engine()
    engine.submit([GenerationRequest("x", [1], SamplingParams(max_new_tokens=2))])
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        engine.release_memory(["kv_cache"])
    _drain(engine)
    engine.release_memory(["kv_cache", "weights"])
    engine.resume_memory(["weights"])
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release_memory(["kv"])
    memory = [c for c in double(engine).calls if c[0].endswith("_occupation")]
    assert memory == [("release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
                      ("resume_memory_occupation", {"tags": ["weights"]})]
    recorder = double(engine)
    engine.shutdown()
    assert recorder.calls[-1][0] == "shutdown"


def test_memory_is_released_only_once_aborted_requests_have_come_back():
    engine = _engine(drain_timeout_s=2.0)
    engine.submit([GenerationRequest(f"held{i}", [1], SamplingParams(max_new_tokens=HOLD)) for i in range(3)])
    engine.abort_all()
    engine.release_memory(["kv_cache"])  # the double asserts like sglang if any is still held
    engine.resume_memory(["kv_cache"])
    assert engine.poll(0.1) == [] and engine.stats().running == 0
    double(engine).ignore_aborts = {"stuck"}
    engine.submit([GenerationRequest("stuck", [1], SamplingParams(max_new_tokens=HOLD))])
    engine.abort(["stuck"])
    with pytest.raises(TimeoutError, match=r"engine 3: sglang has not returned requests \['stuck'\]"):
        engine.wait_idle(timeout_s=0.2)


def test_bad_requests_are_refused_by_name():
    engine = _engine()
    with pytest.raises(RequestError, match="'e': empty prompt.*'t': temperature") as err:
        engine.submit([GenerationRequest("e", [], SamplingParams()),
                       GenerationRequest("ok", [3], SamplingParams(max_new_tokens=1)),
                       GenerationRequest("t", [1], SamplingParams(temperature=-1.0))])
    assert err.value.request_ids == ("e", "t")
    assert list(_drain(engine)) == ["ok"]


def test_token_ids_outside_the_vocabulary_are_refused_by_name():
    """With the checkpoint's config.json at hand, prompt or stop ids outside its vocab_size (297 for the
    shipped policy) never reach sglang, whose embedding lookup would fail for the whole batch."""
    policy = Path(__file__).resolve().parents[2] / "assets" / "policy"
    engine = make_engine(RolloutConfig(backend="sglang"), policy, device="cpu", sglang_host=in_process(RecordingEngine))
    outside = r"'big': token ids \[297, -1, 300\] outside the model's vocabulary \[0, 297\)"
    with pytest.raises(RequestError, match=outside):
        engine.submit([GenerationRequest("big", [3, 297, -1], SamplingParams(max_new_tokens=2, stop_token_ids=(300,))),
                       GenerationRequest("ok", [296], SamplingParams(max_new_tokens=1))])
    assert list(_drain(engine)) == ["ok"]
    assert [c[1]["rid"] for c in double(engine).calls if c[0] == "async_generate"] == ["ok"]


def test_a_release_without_a_weight_session_pushes_at_once_and_flushes_on_an_idle_engine():
    """sglang 0.5.17: no begin/end_weight_update (the surface keeps them out of the API), every push
    still checked; the last push flushes the cache, and waits for held requests to come back first."""
    engine = SGLangEngine("/m", RolloutConfig(backend="sglang", weight_bucket_mb=1, drain_timeout_s=5.0),
                          device="cpu", host=in_process(NoSessionEngine, "0.5.17"))
    assert engine.sglang_version == "0.5.17"
    engine.submit([GenerationRequest(f"held{i}", [1], SamplingParams(max_new_tokens=HOLD)) for i in range(2)])
    engine.abort_all()  # the double holds them for one more step, as sglang does
    mb = torch.zeros(1 << 18)
    engine.update_weights([("w0", mb), ("w1", mb)])
    assert [(c[0], c[1]["names"], c[1]["flush_cache"]) for c in double(engine).calls if "weight" in c[0]] == [
        ("update_weights_from_tensor", ["w0"], False), ("update_weights_from_tensor", ["w1"], True)]
    double(engine).refuse = {"w1"}
    with pytest.raises(WeightSyncError, match=r"engine 0: .*update_weights_from_tensor.*'w1'.*cannot load"):
        engine.update_weights([("w0", mb), ("w1", mb)])
    assert not [c for c in double(engine).calls if "weight_update" in c[0]]
    with pytest.raises(AssertionError, match="not in the API of sglang 0.5.17"):
        engine._host.driver._call("Engine.begin_weight_update")


def test_evict_hands_back_partial_requests_and_resume_continues_them():
    engine = _engine()
    engine.submit([GenerationRequest("held", [1], SamplingParams(max_new_tokens=HOLD)),
                   GenerationRequest("short", [2], SamplingParams(max_new_tokens=2))])
    assert [c.request_id for c in engine.poll(5.0)] == ["short"]
    handed = engine.evict(["held", "unknown"])
    assert [(c.request_id, c.finish_reason) for c in handed] == [("held", FINISH_EVICTED)]
    assert engine.active_request_ids() == [] and engine.poll(0.2) == []
    # the continuation: tokens so far join the prompt, count against max_new_tokens, lead the output
    engine.submit([GenerationRequest("cont", [2], SamplingParams(max_new_tokens=6), resume_ids=(5, 6),
                                     resume_logprobs=(-1.0, -2.0))])
    (done,) = _drain(engine).values()
    call = [c[1] for c in double(engine).calls if c[0] == "async_generate"][-1]
    assert call["input_ids"] == [2, 5, 6] and call["sampling_params"]["max_new_tokens"] == 4
    assert done.output_ids[:2] == [5, 6] and done.logprobs[:2] == [-1.0, -2.0] and len(done.output_ids) == 6
    with pytest.raises(RequestError, match="resumes 2 tokens with 1 log-probs"):
        engine.submit([GenerationRequest("bad", [2], SamplingParams(max_new_tokens=6), (5, 6), (-1.0,))])
