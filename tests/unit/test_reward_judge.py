"""The LLM judge's prompt, verdict parsing and batching, against a scripted engine.

The engine is a stand-in implementing the ``RolloutEngine`` interface: it answers
from a script keyed by the graded response, so the test checks the judge's own
logic (what it asks, how it reads the answer, timeouts), not a model. A reward pool (worker processes)
routing judge samples to it: tests/integration/test_reward_judge_procs.py.
"""
from __future__ import annotations

from rollpacker.reward.score import Score
from rollpacker.reward.scorers.judge import LLMJudge, judge_prompt, parse_verdict
from rollpacker.rollout.engine import Completion, EngineStats, RolloutEngine


class CharTokenizer:
    eos_token_id = 0
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i)


class ScriptedEngine(RolloutEngine):
    """Answers each prompt with the verdict scripted for the response it contains; None never answers."""

    def __init__(self, script: dict[str, str | None]):
        self.script, self.pending, self.aborted, self.batches = script, {}, [], []

    def submit(self, requests):
        self.batches.append(len(requests))
        for r in requests:
            prompt = CharTokenizer().decode(list(r.input_ids))
            self.pending[r.request_id] = next(v for k, v in self.script.items() if f"grade:\n{k}\n" in prompt)

    def poll(self, timeout=0.0):
        done = [Completion(rid, CharTokenizer().encode(text) + [0], [], "stop")
                for rid, text in self.pending.items() if text is not None]
        self.pending = {rid: t for rid, t in self.pending.items() if t is None}
        return done

    def abort(self, request_ids):
        self.aborted += list(request_ids)
        for rid in request_ids:
            self.pending.pop(rid, None)

    def active_request_ids(self):
        return list(self.pending)

    def update_weights(self, named_tensors):
        raise NotImplementedError

    def release_memory(self, tags=()):
        raise NotImplementedError

    def resume_memory(self, tags=()):
        raise NotImplementedError

    def stats(self):
        return EngineStats()


def test_verdict_parsing():
    assert parse_verdict("CORRECT") is True
    assert parse_verdict("The response is incorrect.") is False
    assert parse_verdict("Not CORRECT at first... final: INCORRECT") is False
    assert parse_verdict("Incorrectly formatted but CORRECT") is True
    assert parse_verdict("maybe") is None


def test_prompt_carries_reference_and_response():
    prompt = judge_prompt("  x = 4 ", "4")
    assert "Reference answer:\n4\n" in prompt and "grade:\nx = 4\n" in prompt and prompt.endswith("INCORRECT.")


def test_judge_batches_and_scores_through_futures():
    engine = ScriptedEngine({"right": "CORRECT", "wrong": "INCORRECT", "odd": "hmm", "silent": None})
    judge = LLMJudge(engine, CharTokenizer(), timeout=0.5)
    futures = [judge.submit(r, "42") for r in ("right", "wrong", "odd", "silent")]
    scores: list[Score] = [f.result(timeout=10) for f in futures]
    judge.close()
    assert [(s.reward, s.reason) for s in scores] == [
        (1.0, "ok"), (0.0, "wrong_answer"), (0.0, "error"), (0.0, "timeout")]
    assert len(engine.aborted) == 1 and sum(engine.batches) == 4
