"""Requests decoded together: a `Batcher` owns the engine (a `SpeculativeGenerator`'s decoder) and one worker thread.

When the engine is free, the worker waits `batch_wait` after a request's arrival for others, then takes every waiting
request that samples like the first one (same temperature, top-p, penalties and logit bias), up to `max_batch`, and
decodes them as one batch (`SpeculativeDecoder.generate` on a list of prompts): rows leave the batch at their own EOS,
budget or stop string, and a request whose client went away (`cancelled`) leaves it at the next round. Requests that
arrive meanwhile wait for the next batch; a full queue refuses them (`QueueFull`).
A greedy row's tokens do not depend on the rows beside it (the engine's batch invariance), so a request gets the
same output alone or among others.
"""
from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mamba_draft.cpu_threads import release_openmp_workers
from tree_search.plan import eos_set

RECENT = 256  # outcomes and batch sizes a Batcher remembers
BATCH_WAIT = 0.02  # seconds the idle engine waits after a request for others to join its batch
HOLD = "\ufffd"  # a decoded text ending in a replacement character waits for the rest of its UTF-8 sequence


class QueueFull(RuntimeError):
    """The server's queue holds `max_queue` requests already."""


@dataclass
class Request:
    """One completion: its prompt ids and sampling, and, as the worker decodes it, its tokens, text and outcome.
    on_text: called from the worker thread with each new piece of text (streaming)."""

    ids: list[int]
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    shaping: tuple = ()  # (name, value) logits settings (`processors.Shaping` fields: penalties, logit bias)
    logprobs: int | None = None  # top alternatives to report per token (None: no log-probabilities)
    on_text: Callable[[str], None] | None = None
    on_done: Callable[[], None] | None = None  # called from the worker thread once the request has finished
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the completion so far, cut at a stop string
    sent: int = 0  # characters of `text` handed to on_text
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    stats: dict = field(default_factory=dict)  # τ, rounds, the batch it decoded in
    arrived: float = field(default_factory=time.perf_counter)  # the clock at submission, its first and last token
    first_token_at: float | None = None
    last_token_at: float | None = None
    generation: object = None  # its row's GenerateStats, once decoded
    token_logprobs: list = field(default_factory=list)  # per token taken, its TokenLogprob (where asked)
    logprobs_sent: int = 0  # of token_logprobs, handed on with streamed text
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def sampling(self) -> tuple:
        """Requests that decode together sample and shape their logits alike."""
        return self.temperature, self.top_p, self.shaping

    def take(self, tokens: list[int], tokenizer, eos: set[int], logprobs: list | None = None) -> bool:
        """A round's committed tokens (and their TokenLogprobs) -> whether the row goes on (False: cancelled, budget
        spent, a stop string)."""
        if self.cancelled:
            self.finish_reason = "cancelled"
            return False
        room = self.max_tokens - len(self.tokens)
        self.tokens += tokens[:room]
        if self.logprobs is not None and logprobs is not None:
            self.token_logprobs += logprobs[:room]
        self.last_token_at = time.perf_counter()
        self.first_token_at = self.first_token_at or self.last_token_at
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((text.find(s) for s in self.stop if s in text), default=-1)
        if cut >= 0:
            text, self.finish_reason = text[:cut], "stop"
        elif any(t in eos for t in tokens):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        self.text = text
        self.flush()
        return self.finish_reason is None

    def flush(self) -> None:
        """Hand on the text not sent yet, holding back an incomplete character and a possible stop string's start
        (unless the request has finished)."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if self.text.endswith(s[:n])),
                       default=0)
            while end > self.sent and self.text[end - 1] == HOLD:
                end -= 1
        if self.on_text is not None and end > self.sent:
            self.on_text(self.text[self.sent:end])
        self.sent = max(self.sent, end)

    def finish(self, reason: str | None = None, error: str | None = None) -> None:
        self.finish_reason = self.finish_reason or reason
        self.error = error
        self.flush()
        self.done.set()
        if self.on_done is not None:
            self.on_done()


class Batcher:
    """The engine's one worker: `submit` queues a request, the worker decodes batches of them (module docstring)."""

    def __init__(self, generator, max_batch: int = 8, max_queue: int = 64, metrics=None,
                 batch_wait: float = BATCH_WAIT) -> None:
        if max_batch < 1 or max_queue < 0 or not 0 <= batch_wait <= 10:
            raise ValueError(f"max_batch must be >= 1, max_queue >= 0 and batch_wait in [0, 10] seconds, got "
                             f"{max_batch}, {max_queue}, {batch_wait}")
        self.decoder, self.max_batch, self.max_queue = generator.decoder, max_batch, max_queue
        self.batch_wait = batch_wait
        self.tokenizer, self.eos = generator.tokenizer, eos_set(generator.target, None)
        self.queue: deque[Request] = deque()
        self.wake = threading.Condition()
        self.running = 0  # requests in the batch being decoded
        # counts since start, and the latest outcomes (bounded: a server runs for days)
        self.served = self.batches = 0
        self.finished: deque[tuple[str, int]] = deque(maxlen=RECENT)  # (finish_reason, tokens) of recent requests
        self.batch_sizes: deque[int] = deque(maxlen=RECENT)  # of recent batches
        self.closed = False
        self.metrics = metrics  # `metrics.ServerMetrics` (None: none kept)
        # the worker decodes with the cores to itself: the loading thread's OpenMP team goes, and the worker's own
        # after each batch (`cpu_threads`: teams beyond the core count make every parallel region sleep and wake)
        release_openmp_workers()
        self.worker = threading.Thread(target=self.work, name="mamba-draft-engine", daemon=True)
        self.worker.start()

    def submit(self, request: Request) -> Request:
        with self.wake:
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
            self.queue.append(request)
            self.wake.notify()
        return request

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()
        self.worker.join()

    def next_batch(self) -> list[Request]:
        """The next batch (module docstring); the wait is there because clients that send at once do not arrive at
        once: the first would otherwise decode alone while the rest wait for it."""
        with self.wake:
            while not self.queue and not self.closed:
                self.wake.wait()
            while not self.closed and len(self._alike()) < self.max_batch:
                left = self.queue[0].arrived + self.batch_wait - time.perf_counter()
                if left <= 0:
                    break
                self.wake.wait(left)
            if self.closed:
                return []
            batch = self._alike()
            for request in batch:
                self.queue.remove(request)
            self.running = len(batch)
            return batch

    def _alike(self) -> list[Request]:
        """The first waiting request and those that sample like it, up to max_batch (the lock held)."""
        first = self.queue[0]
        return [r for r in self.queue if r.sampling == first.sampling][: self.max_batch]

    def work(self) -> None:
        while batch := self.next_batch():
            live = [r for r in batch if not r.cancelled]
            for request in batch:
                if request.cancelled:
                    request.finish("cancelled")
            try:
                if live:
                    self.decode(live)
            except Exception as err:  # the requests fail, the server goes on
                for request in live:
                    request.finish("error", f"{type(err).__name__}: {err}")
            finally:
                release_openmp_workers()
                with self.wake:
                    self.running = 0
                    self.finished.extend((r.finish_reason, len(r.tokens)) for r in batch)
                    self.served += len(batch)
                if self.metrics is not None:
                    for r in batch:
                        self.metrics.observe(
                            r.finish_reason or "error", len(r.ids), len(r.tokens),
                            None if r.first_token_at is None else r.first_token_at - r.arrived,
                            (r.last_token_at - r.first_token_at) / (len(r.tokens) - 1) if len(r.tokens) > 1 else None,
                            r.generation)

    def decode(self, batch: list[Request]) -> None:
        first, start = batch[0], time.perf_counter()
        seeds = [r.seed for r in batch]  # a row without a seed draws one: rows never share a random stream
        result = self.decoder.generate(
            [r.ids for r in batch], max_new_tokens=max(r.max_tokens for r in batch), temperature=first.temperature,
            top_p=first.top_p, **dict(first.shaping), seed=None if all(s is None for s in seeds) else
            [random.randrange(2**31) if s is None else s for s in seeds],
            logprobs=max((r.logprobs for r in batch if r.logprobs is not None), default=None),
            on_tokens=lambda row, tokens, logprobs: batch[row].take(tokens, self.tokenizer, self.eos, logprobs))
        seconds = time.perf_counter() - start
        self.batches += 1
        self.batch_sizes.append(len(batch))
        if self.metrics is not None:
            self.metrics.pulled(result.stats.arms)
        for request, row in zip(batch, result.rows):
            request.generation = row.stats
            request.stats = {"tau": row.stats.mean_accepted, "rounds": row.stats.rounds, "batch": len(batch),
                             "seconds": seconds}
            request.finish("length" if len(request.tokens) >= request.max_tokens else "stop")
