"""Choosing the next token from the logits: greedy, or sampled with a temperature and top-p
from a seeded generator (the same draws on every rank, which all hold the same logits)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen and when a prompt stops.

    ``temperature`` 0 is greedy (the argmax: the first of equal maxima); otherwise tokens are
    drawn from ``softmax(logits / temperature)`` restricted to the smallest set of most likely
    tokens whose probability reaches ``top_p``. A prompt stops after ``max_new_tokens`` or at
    a token of ``stop_ids`` (kept in its output, as Hugging Face's ``generate`` keeps EOS)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be 0 (greedy) or positive")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def next_tokens(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """The next token of each row of ``logits`` [P, V] (float32, on the CPU): [P] int64."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of the more likely tokens
        sorted_probs[before >= sampling.top_p] = 0.0  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).flatten()


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first of ``stops`` in it, and whether one was found."""
    found = [text.index(s) for s in stops if s in text]
    return (text[: min(found)], True) if found else (text, False)


def stop_at_strings(tokenizer, stops: Sequence[str]) -> Callable[[int, list[int]], bool] | None:
    """A ``generate`` ``stop_when`` that ends a prompt once one of ``stops`` appears in its
    decoded new tokens (None without stop strings)."""
    if not stops:
        return None
    return lambda p, tokens: cut_at_stop(tokenizer.decode(tokens), stops)[1]
