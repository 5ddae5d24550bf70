"""An optional LLM judge: a model behind the ``RolloutEngine`` interface grades a response.

The judge must own its engine: ``poll`` hands back every finished request, so
an engine shared with the rollout would swallow the rollout's completions.
Samples are batched by a thread of their own, so many judgements share one
engine pass, and each comes back on its own future like any other score.
"""
from __future__ import annotations

import itertools
import logging
import queue
import re
import threading
import time
from concurrent.futures import Future
from typing import Any, Sequence

from rollpacker.reward.score import ERROR, TIMEOUT, WRONG_ANSWER, Score
from rollpacker.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams

log = logging.getLogger(__name__)
_VERDICT = re.compile(r"\b(INCORRECT|CORRECT)\b", re.IGNORECASE)
_PROMPT = (
    "You are grading an answer to a problem against the reference answer.\n"
    "Reference answer:\n{reference}\n\nResponse to grade:\n{response}\n\n"
    "Does the response reach the reference answer? Reply with one word: CORRECT or INCORRECT."
)


def judge_prompt(response: str, reference: str) -> str:
    return _PROMPT.format(reference=reference.strip(), response=response.strip())


def parse_verdict(text: str) -> bool | None:
    """The judge's last CORRECT/INCORRECT word; None when it gave neither."""
    verdicts = _VERDICT.findall(text)
    return None if not verdicts else verdicts[-1].upper() == "CORRECT"


class LLMJudge:
    def __init__(self, engine: RolloutEngine, tokenizer: Any, *, max_new_tokens: int = 16,
                 timeout: float = 120.0, max_batch: int = 64):
        self._engine, self._tokenizer = engine, tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self._params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                      stop_token_ids=() if eos is None else (eos,))
        self._timeout, self._max_batch = timeout, max_batch
        self._ids = itertools.count()
        self._queue: queue.Queue[tuple[str, str, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="reward-judge", daemon=True)
        self._thread.start()

    def submit(self, response: str, reference: Any) -> Future:
        if not isinstance(reference, str):
            raise ValueError(f"judge reference answer must be a string, got {type(reference).__name__}")
        future: Future = Future()
        self._queue.put((response, reference, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def score_batch(self, items: Sequence[tuple[str, str]]) -> list[Score]:
        """Score (response, reference) pairs in one engine pass, waiting at most ``timeout``."""
        start = time.monotonic()
        ids = [f"judge-{next(self._ids)}" for _ in items]
        self._engine.submit([GenerationRequest(rid, self._encode(judge_prompt(*item)), self._params)
                             for rid, item in zip(ids, items)])
        texts: dict[str, str] = {}
        while len(texts) < len(ids) and time.monotonic() - start < self._timeout:
            for done in self._engine.poll(timeout=0.05):
                texts[done.request_id] = self._tokenizer.decode(list(done.output_ids), skip_special_tokens=True)
        self._engine.abort([rid for rid in ids if rid not in texts])
        seconds = time.monotonic() - start
        return [self._verdict_score(texts.get(rid), seconds) for rid in ids]

    def _encode(self, prompt: str) -> list[int]:
        if getattr(self._tokenizer, "chat_template", None):
            prompt = self._tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
            return list(self._tokenizer.encode(prompt, add_special_tokens=False))
        return list(self._tokenizer.encode(prompt))

    @staticmethod
    def _verdict_score(text: str | None, seconds: float) -> Score:
        if text is None:
            return Score.failed(TIMEOUT, "the judge did not answer in time", seconds)
        verdict = parse_verdict(text)
        if verdict is None:
            return Score.failed(ERROR, f"judge gave no verdict: {text[:200]!r}", seconds)
        return Score.passed(seconds) if verdict else Score.failed(WRONG_ANSWER, "judged incorrect", seconds)

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self._max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(item)
            try:
                scores = self.score_batch([(response, reference) for response, reference, _ in batch])
            except Exception as exc:  # noqa: BLE001 - an engine failure scores the batch, it must not hang it
                log.exception("LLM judge failed on a batch of %d", len(batch))
                scores = [Score.failed(ERROR, f"judge engine failed: {exc}")] * len(batch)
            for (_, _, future), score in zip(batch, scores):
                future.set_result(score)
