"""Needle contexts: key-value needles placed at a depth of a filler of known length, the
question(s) at the end, the answers scored teacher-forced. Pure (no process group).

A context of ``length`` tokens is ``head + filler[:at] + needles + filler[at:] + tail``:

- ``head``: what comes before the filler (the chat template's user turn and an
  instruction, or nothing for the recall task);
- ``needles``: ``k`` needles with distinct keys, one after the other, starting at
  ``at = round(depth * filler_length)`` (moved back to the start of a line of real text
  when one starts within :data:`SNAP_TOKENS` tokens before it);
- ``tail``: the question(s), and for text the answers themselves (teacher forcing): every
  needle is asked, in a seeded order, and its answer tokens are labels.

A needle counts as retrieved when every one of its answer tokens is the model's argmax
(exact match): the outcome greedy decoding would give, from one forward.

Two formats:

- :class:`RecallFormat`: the synthetic recall task's own token ids (:mod:`loongtrain.data.recall`):
  a needle is one fact token, a question one query token whose label is the answer;
- :class:`TextFormat`: RULER's multi-key wording tokenized by the model's tokenizer
  ("One of the special magic numbers for <key> is: <value>."), keys adjective-noun pairs
  and values 7-digit numbers as in RULER's niah tasks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loongtrain.data.recall import IGNORE_INDEX, sample_seed

#: How far back (tokens) a needle may move to start on a fresh line of real filler text.
SNAP_TOKENS = 64

#: Words of the text keys ("adjective-noun", as RULER's wonderwords keys; built in, no download).
ADJECTIVES = (
    "amber", "ancient", "brave", "bright", "calm", "clever", "crimson", "curious", "distant", "eager",
    "electric", "fancy", "fierce", "gentle", "golden", "hidden", "hollow", "humble", "icy", "jolly",
    "lively", "lonely", "lucky", "mellow", "misty", "noble", "odd", "pale", "proud", "quiet",
    "rapid", "rustic", "scarlet", "silent", "silver", "sleepy", "smooth", "solemn", "sturdy", "sunny",
    "swift", "tender", "tiny", "vivid", "wandering", "wild", "windy", "wise", "wooden", "young",
)  # fmt: skip
NOUNS = (
    "anchor", "badger", "bakery", "beacon", "bicycle", "blanket", "bridge", "candle", "canyon", "castle",
    "compass", "cottage", "crystal", "dolphin", "engine", "falcon", "feather", "fountain", "garden", "glacier",
    "harbor", "helmet", "island", "journal", "kettle", "lantern", "library", "meadow", "mirror", "mountain",
    "needle", "orchard", "otter", "painting", "pebble", "pillow", "planet", "quarry", "rabbit", "river",
    "saddle", "spoon", "statue", "teapot", "thunder", "tractor", "trumpet", "violin", "walnut", "window",
)  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    """One context's pieces, before the filler is known: token ids of the head, of each
    needle (placed together at the depth) and of the tail; ``targets[j]`` are needle j's
    scored labels as ``(position in the tail, label id)``."""

    head: list[int]
    needles: list[list[int]]
    tail: list[int]
    targets: list[list[tuple[int, int]]]
    keys: list[str]
    values: list[str]

    @property
    def fixed_tokens(self) -> int:
        """Tokens that are not filler."""
        return len(self.head) + sum(map(len, self.needles)) + len(self.tail)


@dataclass(frozen=True)
class Needle:
    """One needle of a context and where it lies."""

    key: str
    value: str
    start: int  # position of its first token in the context
    scored: tuple[int, ...]  # label positions that must all be the argmax (its answer)


@dataclass(frozen=True)
class NeedleContext:
    """One evaluation sequence: ``tokens``/``labels`` [length] (labels IGNORE_INDEX except
    the answers) and its needles."""

    length: int
    depth: float  # asked depth, 0..1 of the filler
    sample: int
    tokens: torch.Tensor
    labels: torch.Tensor
    needles: tuple[Needle, ...]
    filler: tuple[int, int]  # [start, end) of the filler in the context, the needles inside it
    block: int  # tokens of the needles together

    @property
    def placed_depth(self) -> float:
        """Where the needles really start, as a fraction of the filler (after snapping)."""
        start, end = self.filler
        return (self.needles[0].start - start) / max(1, end - start - self.block)


def depth_grid(count: int) -> tuple[float, ...]:
    """``count`` depths evenly spaced from 0 to 1 (one depth: the middle)."""
    if count < 1:
        raise ValueError(f"depths={count} must be at least 1")
    if count == 1:
        return (0.5,)
    return tuple(i / (count - 1) for i in range(count))


def needle_offset(filler_len: int, depth: float) -> int:
    """Filler tokens before the needles for ``depth`` in [0, 1]: ``round(depth * filler_len)``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must lie in [0, 1]")
    return min(filler_len, max(0, round(depth * filler_len)))


def snap_back(filler: Sequence[int], at: int, is_break: Callable[[int], bool] | None, window: int = SNAP_TOKENS) -> int:
    """``at`` moved back to just after the nearest line-break token within ``window`` tokens
    (so a needle starts a line of real text), or ``at`` itself when there is none."""
    if is_break is None or at == 0:
        return at
    for p in range(at, max(0, at - window) - 1, -1):
        if p == 0 or is_break(int(filler[p - 1])):
            return p
    return at


def assemble(
    prompt: Prompt, filler: Callable[[int], np.ndarray], length: int, depth: float, sample: int,
    is_break: Callable[[int], bool] | None = None,
) -> NeedleContext:  # fmt: skip
    """The context of ``length`` tokens: ``prompt``'s pieces around ``filler(n)`` (the filler
    tokens of this context), the needles at ``depth``."""
    room = length - prompt.fixed_tokens
    if room < 1:
        raise ValueError(
            f"the needles and questions take {prompt.fixed_tokens} tokens: no room for filler in a context of "
            f"{length}; use longer contexts or fewer needles"
        )
    hay = np.asarray(filler(room), dtype=np.int64)
    if hay.shape != (room,):
        raise ValueError(f"the filler gave {hay.shape} tokens for {room}")
    at = snap_back(hay, needle_offset(room, depth), is_break)
    block = [t for needle in prompt.needles for t in needle]
    parts = [prompt.head, hay[:at].tolist(), block, hay[at:].tolist(), prompt.tail]
    tokens = torch.tensor([t for part in parts for t in part], dtype=torch.int64)
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.int64)
    tail0 = length - len(prompt.tail)
    needles, pos = [], len(prompt.head) + at
    for j, needle in enumerate(prompt.needles):
        scored = []
        for offset, label in prompt.targets[j]:
            labels[tail0 + offset] = label
            scored.append(tail0 + offset)
        needles.append(Needle(prompt.keys[j], prompt.values[j], pos, tuple(scored)))
        pos += len(needle)
    return NeedleContext(length, depth, sample, tokens, labels, tuple(needles), (len(prompt.head), tail0), len(block))


def context_rng(seed: int, length: int, sample: int) -> random.Random:
    """The generator of the keys, values and question order of the contexts of one (length,
    sample): the same needles at every depth, so a heatmap row differs only in where they are."""
    return random.Random(sample_seed("needle", seed, length, sample))


def filler_seed(seed: int, length: int, sample: int) -> int:
    """Seed of the filler of the contexts of one (length, sample): the same filler at every depth."""
    return sample_seed("needle-filler", seed, length, sample)


# -- the recall task's tokens ----------------------------------------------------------------


@dataclass(frozen=True)
class RecallFormat:
    """Needles in the synthetic recall task's ids (:class:`~loongtrain.data.recall.RecallTask`):
    a needle is the fact token ``filler + key * values + value``, its question the query token
    ``query0 + key`` at the end, scored at the query's own position with label
    ``answer0 + value``. Filler tokens are uniform in ``[0, filler)`` as in training."""

    keys: int
    values: int
    filler: int

    @property
    def vocab_size(self) -> int:
        return self.filler + self.keys * self.values + self.keys + self.values

    @property
    def chance(self) -> float:
        return 1.0 / self.values

    def prompt(self, rng: random.Random, k: int) -> Prompt:
        if k > self.keys:
            raise ValueError(f"{k} needles need {k} distinct keys, the recall task has {self.keys}")
        keys = rng.sample(range(self.keys), k)
        values = [rng.randrange(self.values) for _ in keys]
        order = rng.sample(range(k), k)
        query0 = self.filler + self.keys * self.values
        answer0 = query0 + self.keys
        needles = [[self.filler + key * self.values + value] for key, value in zip(keys, values)]
        tail = [query0 + keys[j] for j in order]
        targets: list[list[tuple[int, int]]] = [[] for _ in keys]
        for pos, j in enumerate(order):
            targets[j].append((pos, answer0 + values[j]))
        return Prompt([], needles, tail, targets, [str(k) for k in keys], [str(v) for v in values])

    def filler_tokens(self, seed: int) -> Callable[[int], np.ndarray]:
        def make(n: int) -> np.ndarray:
            gen = torch.Generator().manual_seed(seed)
            return torch.randint(0, self.filler, (n,), generator=gen).numpy()

        return make


# -- tokenized text ---------------------------------------------------------------------------

#: RULER's "repeat" haystack (niah_single_1): the synthetic filler when no token file is given.
REPEAT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
CHAT_MARK = "\x00NEEDLE-PROMPT\x00"


def join_keys(keys: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b, and c``."""
    if len(keys) <= 2:
        return " and ".join(keys)
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


class TextFormat:
    """RULER-style key-value needles in text, tokenized with ``tokenizer`` (an object of
    :mod:`loongtrain.data.tokenizer`: ``encode``, ``decode``, ``wrap``; ``render_chat`` for
    ``chat``). With ``chat`` the instruction, filler and question form the user turn of the
    tokenizer's chat template and the answers the assistant turn."""

    chance = 0.0  # a 7-digit value by guessing: 1e-7

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._breaks: dict[int, bool] = {}
        if chat:
            rendered = tokenizer.render_chat([{"role": "user", "content": CHAT_MARK}], add_generation_prompt=True)
            before, after = rendered.split(CHAT_MARK)
            self.user_open, self.user_close = self._ids(before), self._ids(after)
        else:
            self.user_open, self.user_close = list(tokenizer.wrap()[0]), self._ids("\n")

    def _ids(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)] if text else []

    def leading_space(self, ids: list[int]) -> int:
        """How many of the first tokens of ``ids`` are whitespace only (a tokenizer that writes
        " 3332350" as " " + digits): teacher-forced but not scored, since "\n3332350" answers too."""
        n = 0
        while n < len(ids) - 1 and not self.tokenizer.decode([ids[n]]).strip():
            n += 1
        return n

    def is_break(self, token: int) -> bool:
        """Whether ``token`` ends a line (a needle may start right after it)."""
        found = self._breaks.get(token)
        if found is None:
            found = self._breaks[token] = "\n" in self.tokenizer.decode([token])
        return found

    def prompt(self, rng: random.Random, k: int) -> Prompt:
        pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), k)
        keys = [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]
        values = [str(rng.randint(10**6, 10**7 - 1)) for _ in keys]
        order = rng.sample(range(k), k)
        many = k > 1
        intro = (
            f"{'Some' if many else 'A'} special magic number{'s are' if many else ' is'} hidden within the "
            f"following text. Make sure to memorize {'them' if many else 'it'}. I will quiz you about the "
            f"number{'s' if many else ''} afterwards.\n"
        )
        needle = "\nOne of the special magic numbers for {} is: {}.\n"
        needles = [self._ids(needle.format(key, value)) for key, value in zip(keys, values)]
        asked = [keys[j] for j in order]
        question = (
            f"\nWhat {'are all the special magic numbers' if many else 'is the special magic number'} for "
            f"{join_keys(asked)} mentioned in the provided text?"
        )
        tail = self._ids(question) + self.user_close
        targets: list[list[tuple[int, int]]] = [[] for _ in keys]
        for n, j in enumerate(order):
            if n:
                tail += self._ids(".\n")
            tail += self._ids(f"The special magic number for {keys[j]} mentioned in the provided text is:")
            answer = self._ids(f" {values[j]}")
            lead = self.leading_space(answer)
            for n_token, token in enumerate(answer):
                if n_token >= lead:  # the value is scored, not the whitespace before it
                    targets[j].append((len(tail) - 1, token))  # the label at p predicts token p + 1
                tail.append(token)
        return Prompt(self.user_open + self._ids(intro), needles, tail, targets, keys, values)

    def repeat_filler(self) -> Callable[[int], np.ndarray]:
        """RULER's repeated sentences, tokenized once and tiled."""
        unit = np.asarray(self._ids(REPEAT_FILLER), dtype=np.int64)

        def make(n: int) -> np.ndarray:
            return np.tile(unit, -(-n // len(unit)))[:n]

        return make


def file_filler(tokens: np.ndarray, starts: np.ndarray | None, seed: int) -> Callable[[int], np.ndarray]:
    """``n`` consecutive tokens of a token file (``tokens``, memory-mapped), from a document start
    chosen by ``seed`` among those with ``n`` tokens after them (any offset when the file
    records no documents)."""

    def make(n: int) -> np.ndarray:
        count = tokens.shape[0]
        if n > count:
            raise ValueError(f"the filler needs {n} tokens, the token file has {count}")
        gen = random.Random(seed)
        if starts is not None:
            fits = starts[starts + n <= count]
            if fits.size:
                start = int(fits[gen.randrange(fits.size)])
                return np.asarray(tokens[start : start + n], dtype=np.int64)
        start = gen.randrange(count - n + 1)
        return np.asarray(tokens[start : start + n], dtype=np.int64)

    return make
