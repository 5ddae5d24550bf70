"""The reference rollout engine: continuous batching in plain PyTorch, on CPU or GPU.

Scheduling (on the leader):
- KV lives in fixed-size pages (``RolloutConfig.kv_page_size`` tokens) out of a
  budget of ``kv_cache_tokens``. A waiting request is admitted, FIFO, when the
  pages for its prompt + generated tokens + the next token are free.
- Every step decodes one token for all running requests in ONE batched forward
  (keys gathered from each row's pages, masked SDPA), then prefills the newly
  admitted requests in one right-padded forward. Per-row state (lengths, page
  tables, sampling parameters, outputs) lives in row-aligned tensors, so the hot
  path has no per-request Python; only finished requests are handled one by one.
- When a running request needs a new page and none is free, the most recently
  admitted request is preempted by recompute: its KV is dropped, its generated
  tokens kept, and it is re-queued at the front (it is re-prefilled over prompt +
  generated tokens on re-admission, which yields its next token).
- ``RolloutConfig.return_routing`` on a MoE model: the leader appends the experts each forward
  chose at each newly fed position to its request's record (``Completion.routed_experts``); a
  re-prefill after a preemption recomputes positions already recorded and keeps the first routing.

Tensor parallelism: a process group of ranks forms one engine. The group's first
rank (the leader) owns all scheduling state and samples from full logits (lm_head
is replicated); before each forward it broadcasts the ``ForwardPlan``, and the
followers, inside ``serve_follower()``, run the same forward in lockstep until
``stop_followers()``. Page allocation is leader-only: every rank's KV pool has the
same page layout, so abort and preemption need no message. Weight updates and
memory release/resume are made by every rank of the group with the same full
tensors or tags, so they need no broadcast either.
"""
from __future__ import annotations

import array
import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import (FINISH_LENGTH, FINISH_STOP, MEMORY_TAGS, Completion, EngineStats,
                                       GenerationRequest, request_problem)
from rollpacker.hf_spec import ModelSpec, parse_spec
from rollpacker.rollout.inprocess import InProcessEngine, QueuedRequest, check_tags
from rollpacker.rollout.qwen_torch import ForwardPlan, QwenTP, iter_safetensors
from rollpacker.rollout.sampling import sample

ModelSource = str | Path | tuple[dict | ModelSpec, Mapping[str, torch.Tensor]]


@dataclass
class _Rows:
    """Decode state of the running batch: row ``i`` belongs to the ``i``-th running request."""

    seq_len: torch.Tensor  # tokens whose KV is stored
    last_token: torch.Tensor  # sampled, not yet in KV
    n_gen: torch.Tensor
    max_new: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    n_pages: torch.Tensor
    stops: torch.Tensor  # [B, S], padded with -1
    uniforms: torch.Tensor  # [B, U]
    out_ids: torch.Tensor  # [B, G]
    out_lp: torch.Tensor  # [B, G]
    block_table: torch.Tensor  # [B, P], padded with page 0 (masked out)

    _PAD = {"stops": -1}

    def select(self, index: torch.Tensor) -> "_Rows":
        return _Rows(**{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})

    def cat(self, other: "_Rows") -> "_Rows":
        return _Rows(**{f.name: _cat_padded(getattr(self, f.name), getattr(other, f.name),
                                            self._PAD.get(f.name, 0)) for f in dataclasses.fields(self)})


def _cat_padded(a: torch.Tensor, b: torch.Tensor, fill: int) -> torch.Tensor:
    if a.dim() == 2 and a.shape[1] != b.shape[1]:
        width = max(a.shape[1], b.shape[1])
        a, b = (F.pad(x, (0, width - x.shape[1]), value=fill) for x in (a, b))
    return torch.cat((a, b))


def _padded(rows: Sequence[Sequence[float]], fill: float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), max(1, max(len(r) for r in rows))), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


class ReferenceEngine(InProcessEngine):
    """Continuous-batching Qwen2/Qwen3/Qwen3-MoE engine over a paged KV budget, optionally tensor- and expert-parallel.

    ``model``: an HF Qwen2 or Qwen3 directory (``config.json`` + ``*.safetensors``), or a pair
    ``(HF config dict or ModelSpec, {HF name: full tensor})``. ``cfg``: the rollout
    section (``kv_cache_tokens``, ``kv_page_size``, ``max_running_requests``,
    ``max_prefill_tokens``, ``seed``, ``return_routing``). ``group``: the ranks forming this engine (None:
    this process alone); every rank of the group constructs the engine; the leader
    (group rank 0) makes the request-plane calls while the others sit in
    ``serve_follower()``; control-plane calls are made by every rank (see ``RolloutEngine``).
    ``device``: where weights and KV live; ``dtype``: parameter and KV dtype; ``ep``: a MoE model's
    experts split over this many blocks of the group's ranks (``QwenTP``).
    """

    def __init__(self, model: ModelSource, cfg: RolloutConfig, group: dist.ProcessGroup | None = None,
                 engine_id: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 ep: int = 1):
        cfg.validate()
        self.cfg, self.engine_id, self.group = cfg, engine_id, group
        self.tp_size = 1 if group is None else dist.get_world_size(group)
        self.is_leader = group is None or dist.get_rank(group) == 0
        self._leader = 0 if group is None else dist.get_global_rank(group, 0)
        if isinstance(model, (str, Path)):
            spec, tensors = parse_spec(model), iter_safetensors(model)
        else:
            spec = model[0] if isinstance(model[0], ModelSpec) else parse_spec(model[0])
            tensors = iter(model[1].items())
        self.spec = spec
        self.model = QwenTP(spec, tp_rank=0 if group is None else dist.get_rank(group), tp_size=self.tp_size,
                             ep_size=ep, group=group, dtype=dtype, device=device)
        self.model.allocate()
        self.model.load_all(tensors)
        self.page_size = cfg.kv_page_size
        self.num_pages = math.ceil(cfg.kv_cache_tokens / self.page_size)
        self.kv = self.model.new_kv(self.num_pages, self.page_size)
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._init_queues(cfg.seed, engine_id)
        self._rows: _Rows | None = None
        self._missing_weights: set[str] = set()
        self._stats = EngineStats(kv_tokens_capacity=self.num_pages * self.page_size)
        # routing replay: the experts chosen per fed position, stored as narrow as the expert count allows
        self._routing = cfg.return_routing and bool(spec.moe_layers)
        if self._routing:
            self._route_width = len(spec.moe_layers) * spec.experts_per_token  # ints per position
            narrow = (("B", torch.uint8, 1 << 8), ("h", torch.int16, 1 << 15), ("i", torch.int32, 1 << 31))
            self._route_code, self._route_dtype = next((c, d) for c, d, n in narrow if spec.num_experts <= n)

    # ---- interface -----------------------------------------------------------------------------
    def abort(self, request_ids: Iterable[str]) -> None:
        self._require_leader()
        ids = set(request_ids)
        self._waiting = deque(r for r in self._waiting if r.req.request_id not in ids)
        self._done = [c for c in self._done if c.request_id not in ids]
        hit = [i for i, r in enumerate(self._running) if r.req.request_id in ids]
        if hit:
            for i in hit:
                self._free_row_pages(i)
            self._drop_rows(hit)

    def evict(self, request_ids: Iterable[str]) -> list[Completion]:
        self._require_leader()
        ids = set(request_ids)
        for i, r in enumerate(self._running):
            if r.req.request_id in ids:
                self._snapshot(i)
        answer = self._evicted(ids)
        self.abort(ids)
        return answer

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every rank of the group: load full HF tensors in place, each rank keeping its shard."""
        if not self.model.allocated:
            raise RuntimeError(f"engine {self.engine_id}: weights are released; resume_memory(['weights']) first")
        for name, tensor in named_tensors:
            if not self.model.has_weight(name):
                raise KeyError(f"engine {self.engine_id}: unknown {self.spec.model_type} weight name {name!r}")
            self.model.load(name, tensor.detach().to(self.model.device, self.model.dtype).contiguous())
            self._missing_weights.discard(name)

    def max_weight_diff(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        worst = 0.0
        for name, tensor in named_tensors:
            worst = max(worst, self.model.shard_diff(name, tensor.detach().to(self.model.device, self.model.dtype)))
        return worst

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Every rank of the group: drop the KV cache and/or weights (CPU: the tensors)."""
        if self._running or self._waiting:
            raise RuntimeError(f"engine {self.engine_id}: release_memory needs an idle engine "
                               f"({len(self._running)} running, {len(self._waiting)} waiting)")
        check_tags(tags)
        self._release(tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Every rank of the group: re-allocate; after ``weights`` the engine serves only once
        ``update_weights`` refilled them."""
        check_tags(tags)
        self._resume(tags)
        if "weights" in tags:
            self._missing_weights = set(self.model.hf_names())

    def stats(self) -> EngineStats:
        s = dataclasses.replace(self._stats, running=len(self._running), waiting=len(self._waiting),
                                kv_tokens_used=(self.num_pages - len(self._free_pages)) * self.page_size)
        s.extra = {"kv_tokens_stored": 0 if self._rows is None else int(self._rows.seq_len.sum()),
                   "tp": self.tp_size}
        return s

    def shutdown(self) -> None:
        """Every rank of the group (after the leader stopped its followers): drop all memory."""
        self._waiting.clear()
        self._running, self._rows, self._done = [], None, []
        self._release(MEMORY_TAGS)

    def stop_followers(self) -> None:
        self._require_leader()
        self._send("stop", None)

    def serve_follower(self) -> str:
        """Follower loop: mirror the leader's forwards until it calls ``stop_followers``."""
        if self.is_leader:
            raise RuntimeError("serve_follower is for the non-leader ranks of a TP group")
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=self._leader, group=self.group)
            cmd, arg = box[0]
            if cmd == "forward":
                self.model.forward(arg, self.kv)
            elif cmd == "stop":
                return cmd
            else:
                raise RuntimeError(f"unknown command {cmd!r} from the leader")

    # ---- validation and memory -----------------------------------------------------------------
    def _running_generated(self) -> list[int]:
        # a running request's output_ids holds only the tokens it had when admitted; its row counts on
        return [] if self._rows is None else self._rows.n_gen.tolist()

    def _check_serving(self) -> None:
        if self._missing_weights:
            raise RuntimeError(f"engine {self.engine_id}: weights were released; update_weights must "
                               f"provide all of them before serving ({len(self._missing_weights)} missing)")
        if self.kv is None:
            raise RuntimeError(f"engine {self.engine_id}: KV cache released; call resume_memory first")

    def _require_leader(self) -> None:
        if not self.is_leader:
            raise RuntimeError("engine methods are called on the TP group's leader; followers run serve_follower()")

    def _problem(self, r: GenerationRequest, active: set[str]) -> str | None:
        problem = request_problem(r, active, self.spec.vocab_size)
        if problem:
            return problem
        n, p = len(r.input_ids), r.params
        if n + p.max_new_tokens > self.spec.max_position_embeddings:
            return (f"prompt ({n}) + max_new_tokens ({p.max_new_tokens}) exceeds the context "
                    f"{self.spec.max_position_embeddings}")
        if math.ceil((n + p.max_new_tokens) / self.page_size) > self.num_pages:
            return (f"prompt + max_new_tokens ({n + p.max_new_tokens}) exceeds the KV budget "
                    f"{self.num_pages * self.page_size} tokens (rollout.kv_cache_tokens)")
        return None

    def _release(self, tags: Sequence[str]) -> None:
        if "kv_cache" in tags:
            self.kv = None
        if "weights" in tags:
            self.model.release()

    def _resume(self, tags: Sequence[str]) -> None:
        if "kv_cache" in tags and self.kv is None:
            self.kv = self.model.new_kv(self.num_pages, self.page_size)
        if "weights" in tags and not self.model.allocated:
            self.model.allocate()

    def _send(self, cmd: str, arg: object) -> None:
        if self.tp_size > 1:
            dist.broadcast_object_list([(cmd, arg)], src=self._leader, group=self.group)

    # ---- scheduling ----------------------------------------------------------------------------
    def _step(self) -> None:
        if self._running:
            self._grow_pages()
        if self._running:
            rows = self._rows
            pos = rows.seq_len
            pages = rows.block_table.gather(1, (pos // self.page_size).unsqueeze(1)).squeeze(1)
            used_pages = int(rows.n_pages.max())  # the table may be wider than any row needs
            plan = ForwardPlan("decode", rows.last_token.unsqueeze(1), pos + 1, pages, pos % self.page_size,
                               rows.block_table[:, :used_pages])
            routes = [] if self._routing else None
            logits = self._forward(plan, routes)
            if routes is not None:
                self._record_decode_routing(routes)
            rows.seq_len = pos + 1
            self._emit(rows, logits)
        self._admit()
        self._retire_finished()

    def _forward(self, plan: ForwardPlan, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        self._send("forward", plan)  # followers route alike and report nothing
        # Logits stay where the model is: copying [batch, vocab] to the host every step cost
        # ~120 ms per decode step at batch 256 with a 152k vocabulary on an H100.
        return self.model.logits(self.model.forward(plan, self.kv, routes))

    def _routes_host(self, routes: list[torch.Tensor]) -> torch.Tensor:
        """A forward's ``routes`` as one host tensor [B, T, sparse layers * k] of ``_route_dtype``."""
        return torch.stack(routes, 2).to(self._route_dtype).flatten(2).cpu()

    def _record_decode_routing(self, routes: list[torch.Tensor]) -> None:
        """Append the decode step's routing (one position per running row) to each row's request."""
        step = self._routes_host(routes)[:, 0].numpy()
        for r, row in zip(self._running, step):
            r.routing.frombytes(row)

    def _record_prefill_routing(self, reqs: list[QueuedRequest], lengths: list[int],
                                routes: list[torch.Tensor]) -> None:
        """Append the prefill's routing of the positions each request had not recorded yet (a preempted
        request's recomputed positions keep their first routing)."""
        prefill = self._routes_host(routes).numpy()
        for r, row, n in zip(reqs, prefill, lengths):
            if r.routing is None:
                r.routing = array.array(self._route_code)
            r.routing.frombytes(row[len(r.routing) // self._route_width:n])

    def _routed(self, r: QueuedRequest, n_gen: int) -> Sequence[int]:
        """``r``'s ``Completion.routed_experts`` once it generated ``n_gen`` tokens."""
        if not self._routing:
            return ()
        fed = len(r.req.input_ids) + n_gen - 1
        assert len(r.routing) == fed * self._route_width, (r.req.request_id, len(r.routing), fed)
        return r.routed_experts()

    def _emit(self, rows: _Rows, logits: torch.Tensor) -> None:
        """Sample each row's next token and record it with its log-prob."""
        col = rows.n_gen.unsqueeze(1)
        uniforms = rows.uniforms.gather(1, col.clamp(max=rows.uniforms.shape[1] - 1)).squeeze(1)
        on = logits.device  # sample where the logits are; only the chosen tokens come back
        tokens, logprobs = sample(logits, rows.temperature.to(on), rows.top_p.to(on), rows.top_k.to(on),
                                  uniforms.to(on))
        tokens, logprobs = tokens.cpu(), logprobs.cpu()
        rows.out_ids.scatter_(1, col, tokens.unsqueeze(1))
        rows.out_lp.scatter_(1, col, logprobs.unsqueeze(1))
        rows.n_gen = rows.n_gen + 1
        rows.last_token = tokens
        self._stats.tokens_generated += len(tokens)

    def _grow_pages(self) -> None:
        """Give a new page to rows whose next token starts one, preempting the newest rows if short."""
        rows = self._rows
        need = (rows.seq_len == rows.n_pages * self.page_size).nonzero().flatten().tolist()
        while len(need) > len(self._free_pages):
            victim = len(self._running) - 1
            self._preempt(victim)
            need = [i for i in need if i != victim]
        if not need:
            return
        rows = self._rows
        if int(rows.n_pages.max()) >= rows.block_table.shape[1]:
            rows.block_table = F.pad(rows.block_table, (0, rows.block_table.shape[1]))
        idx = torch.tensor(need)
        rows.block_table[idx, rows.n_pages[idx]] = torch.tensor([self._free_pages.pop() for _ in need])
        rows.n_pages[idx] += 1

    def _snapshot(self, i: int) -> None:
        """Copy running row ``i``'s generated tokens into its request record."""
        r, rows = self._running[i], self._rows
        n = int(rows.n_gen[i])
        r.output_ids = rows.out_ids[i, :n].tolist()
        r.logprobs = rows.out_lp[i, :n].tolist()

    def _preempt(self, i: int) -> None:
        r = self._running[i]
        self._snapshot(i)
        self._free_row_pages(i)
        self._drop_rows([i])
        self._waiting.appendleft(r)
        self._stats.preemptions += 1

    def _free_row_pages(self, i: int) -> None:
        self._free_pages.extend(self._rows.block_table[i, :int(self._rows.n_pages[i])].tolist())

    def _drop_rows(self, drop: Sequence[int]) -> None:
        gone = set(drop)
        keep = [i for i in range(len(self._running)) if i not in gone]
        self._running = [self._running[i] for i in keep]
        self._rows = self._rows.select(torch.tensor(keep, dtype=torch.long)) if keep else None

    def _admit(self) -> None:
        """Admit waiting requests FIFO while their pages fit, and prefill them in one forward."""
        admitted: list[tuple[QueuedRequest, list[int]]] = []
        longest = 0
        while self._waiting and len(self._running) + len(admitted) < self.cfg.max_running_requests:
            r = self._waiting[0]
            length = len(r.req.input_ids) + len(r.output_ids)
            pages = math.ceil((length + 1) / self.page_size)
            padded = (len(admitted) + 1) * max(longest, length)
            if pages > len(self._free_pages) or (admitted and padded > self.cfg.max_prefill_tokens):
                break
            self._waiting.popleft()
            admitted.append((r, [self._free_pages.pop() for _ in range(pages)]))
            longest = max(longest, length)
        if not admitted:
            return
        reqs = [r for r, _ in admitted]
        seqs = [list(r.req.input_ids) + r.output_ids for r in reqs]
        lengths = torch.tensor([len(s) for s in seqs])
        table = _padded([p for _, p in admitted], 0, torch.long)
        t = torch.arange(longest).expand(len(seqs), longest)
        valid = t < lengths.unsqueeze(1)
        plan = ForwardPlan("prefill", _padded(seqs, 0, torch.long), lengths,
                           table.gather(1, t // self.page_size)[valid], (t % self.page_size)[valid])
        routes = [] if self._routing else None
        logits = self._forward(plan, routes)
        if routes is not None:
            self._record_prefill_routing(reqs, lengths.tolist(), routes)
        params = [r.req.params for r in reqs]
        rows = _Rows(seq_len=lengths, last_token=torch.zeros(len(reqs), dtype=torch.long),
                     n_gen=torch.tensor([len(r.output_ids) for r in reqs]),
                     max_new=torch.tensor([p.max_new_tokens for p in params]),
                     temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
                     top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
                     top_k=torch.tensor([p.top_k for p in params]),
                     n_pages=torch.tensor([len(p) for _, p in admitted]),
                     stops=_padded([p.stop_token_ids for p in params], -1, torch.long),
                     uniforms=_padded([r.uniforms.tolist() for r in reqs], 0.0, torch.float32),
                     out_ids=_padded([r.output_ids for r in reqs], 0, torch.long),
                     out_lp=_padded([r.logprobs for r in reqs], 0.0, torch.float32),
                     block_table=table)
        width = int(rows.max_new.max())
        rows.out_ids = F.pad(rows.out_ids, (0, width - rows.out_ids.shape[1]))
        rows.out_lp = F.pad(rows.out_lp, (0, width - rows.out_lp.shape[1]))
        self._emit(rows, logits)
        self._running.extend(reqs)
        self._rows = rows if self._rows is None else self._rows.cat(rows)

    def _retire_finished(self) -> None:
        rows = self._rows
        if rows is None:
            return
        stopped = (rows.stops == rows.last_token.unsqueeze(1)).any(1)
        finished = (stopped | (rows.n_gen >= rows.max_new)).nonzero().flatten().tolist()
        now = time.monotonic()
        for i in finished:
            r, n = self._running[i], int(rows.n_gen[i])
            self._done.append(Completion(
                request_id=r.req.request_id, output_ids=rows.out_ids[i, :n].tolist(),
                logprobs=rows.out_lp[i, :n].tolist(), finish_reason=FINISH_STOP if stopped[i] else FINISH_LENGTH,
                submitted_at=r.submitted_at, finished_at=now, engine_id=self.engine_id,
                routed_experts=self._routed(r, n)))
            self._free_row_pages(i)
        if finished:
            self._drop_rows(finished)
