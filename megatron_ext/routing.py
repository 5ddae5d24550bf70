"""Routing replay: a MoE model's routers take the experts the rollout engine chose for each token.

The trainer's own top-k can differ from the engine's where two experts' scores nearly tie (another
kernel, another precision), and then a token's log-prob is computed through other experts than the
ones that generated it. With replay (``trainer.routing_replay``, the model built with
megatron-core's ``moe_enable_routing_replay``) each router keeps its softmax and load-balancing loss
but takes its top-k indices from the engine (megatron-core's ``RouterReplay``, REPLAY_FORWARD: the
weights are the router's own scores at those experts). Each model's routers are set directly, not
through ``RouterReplay``'s process-wide list of instances, which every model built in the process
joins.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_ext.weights import unwrap


def _replays(model: torch.nn.Module) -> list[tuple[int, RouterReplay]]:
    """(index among the model's sparse layers, its router's replay) for this stage's sparse layers."""
    model = unwrap(model)
    sparse = list(model.hf_spec.moe_layers)
    out = []
    for layer in model.decoder.layers:
        number = layer.layer_number - 1  # global, from 1
        if number in sparse:
            replay = layer.mlp.router.router_replay
            if replay is None:
                raise ValueError("the model was built without routing replay (build_model(routing_replay=True))")
            out.append((sparse.index(number), replay))
    return out


@contextlib.contextmanager
def replayed(model: torch.nn.Module, routing: torch.Tensor | None) -> Iterator[None]:
    """Within: the routers of ``model`` replay ``routing`` ([batch, sequence, sparse layers, k], the
    micro-batch's token grid) in forward; None: they route themselves."""
    if routing is None:
        yield
        return
    replays = _replays(model)
    # Megatron's hidden states are sequence-first: the router sees tokens in (position, row) order,
    # under sequence parallelism this TP rank's share of the positions
    by_token = routing.transpose(0, 1)
    mcore = unwrap(model)
    if mcore.config.sequence_parallel:
        tp = mcore.pg_collection.tp
        by_token = by_token.chunk(tp.size())[tp.rank()]
    for index, replay in replays:
        replay.clear_indices()
        replay.set_target_indices(by_token[:, :, index].reshape(-1, by_token.shape[-1]).contiguous())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _, replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()
