"""The stats side of `generate`: phase times and per-round counts. A round's phase boundaries are CUDA events on a
GPU (`perf_counter` on CPU), read once per round with one wait, instead of a device synchronize at every boundary."""
from __future__ import annotations

import time

import torch

# A round's marks: drafting starts, verification starts, verification ends, drafter resync starts, round ends.
DRAFT, VERIFY, VERIFIED, RESYNC, DONE = range(5)


class Recorder:
    """Fills one call's GenerateStats with its draft / verify / total time."""

    def __init__(self, stats, device: torch.device) -> None:
        self.stats = stats
        self.device = device
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if device.type == "cuda" else None
        self.clock = [0.0] * 5
        self.started = time.perf_counter()

    def mark(self, slot: int) -> None:
        """Note the time once the device reaches this point (an event, so the host does not wait here)."""
        if self.events is None:
            self.clock[slot] = time.perf_counter()
        else:
            self.events[slot].record()

    def _wait(self, slot: int) -> None:
        if self.events is not None:
            self.events[slot].synchronize()

    def _seconds(self, start: int, stop: int) -> float:
        if self.events is None:
            return self.clock[stop] - self.clock[start]
        return self.events[start].elapsed_time(self.events[stop]) / 1000.0

    def round_times(self, finished: bool) -> tuple[float, float]:
        """Read the round's marks (one wait, on its last), add its draft and verify time to the stats -> the
        (draft, verify) seconds the policy is charged: the whole round, commit as verification, resync as drafting."""
        self._wait(VERIFIED if finished else DONE)
        draft, verify = self._seconds(DRAFT, VERIFY), self._seconds(VERIFY, VERIFIED)
        self.stats.verify_time += verify
        if not finished:
            draft += self._seconds(RESYNC, DONE)
            verify = self._seconds(VERIFY, RESYNC)
        self.stats.draft_time += draft
        return draft, verify

    def decode_time(self) -> None:
        """Autoregressive rounds: the decode between VERIFY and VERIFIED is verification time."""
        self._wait(VERIFIED)
        self.stats.verify_time += self._seconds(VERIFY, VERIFIED)

    def total_time(self) -> float:
        """Seconds since construction, once the device has finished everything queued (one sync per call)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.started
