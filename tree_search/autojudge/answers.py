"""Pluggable answer extraction and equivalence for AutoJudge mining (GSM8K final number built in, exact string fallback)."""
from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
# Where a GSM8K response states its result; the last marker wins, the first number after it is the answer.
_MARKERS = re.compile(r"####|answer is|answer:", re.IGNORECASE)


@dataclass(frozen=True)
class AnswerTask:
    """How to read the final answer out of a response and decide whether two answers are the same."""

    extract: Callable[[str], Any]
    equivalent: Callable[[Any, Any], bool]


def _to_number(text: str) -> Fraction:
    return Fraction(text.replace(",", "").replace("$", ""))


def gsm8k_answer(text: str) -> Fraction | None:
    """The final number of a GSM8K-style response ("#### 42", "the answer is 42", else the last number); None if none."""
    markers = list(_MARKERS.finditer(text))
    if markers:
        found = _NUMBER.search(text, markers[-1].end())
        if found:
            return _to_number(found.group())
    numbers = _NUMBER.findall(text)
    return _to_number(numbers[-1]) if numbers else None


# Fraction equality makes "3.5" and "3.50" the same number; None == None (both unreadable). "exact": the whole
# response, whitespace-trimmed (tokens matter only if they change the text itself).
TASKS: dict[str, AnswerTask] = {
    "gsm8k": AnswerTask(gsm8k_answer, operator.eq),
    "exact": AnswerTask(str.strip, operator.eq),
}


def get_task(name: str) -> AnswerTask:
    """Look up a built-in answer task by name."""
    if name not in TASKS:
        raise ValueError(f"unknown AutoJudge task {name!r}; choose one of {sorted(TASKS)} or pass an AnswerTask")
    return TASKS[name]
