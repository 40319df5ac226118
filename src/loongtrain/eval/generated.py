"""Long-context tasks answered by free generation, beside the teacher-forced needle grid:
the prompt ends where the answer starts, the model generates (greedy, on the ranks and layout
of training: :mod:`loongtrain.generate`), and the answer is scored in what it wrote. Pure
here (the contexts and the scores); :func:`~loongtrain.eval.runner.run_generated` runs them.

The tasks follow RULER's definitions (Hsieh et al., 2024, ``scripts/data/synthetic``), on
the grid's contexts (a depth x length heatmap per task, the filler of the grid: a token file
of the user's real text, or RULER's repeated sentences):

- ``niah_single``: one key-value needle, asked (RULER ``niah_single_2``: word keys, 7-digit values);
- ``niah_multikey``: ``eval.needles`` needles with distinct keys, one asked (``niah_multikey_1``);
- ``niah_multivalue``: one key with ``eval.needles`` values, all asked (``niah_multivalue``);
- ``vt``: variable tracking, one chain of 4 hops (``vt``: ``VAR AAAAA = 12345``,
  ``VAR BBBBB = VAR AAAAA``, ...), every variable holding the value asked.

Scores are RULER's ``string_match_all``: the fraction of the expected strings found in the
generated text (case-insensitive). What differs from RULER: the needles of a context lie
together at one depth of a fixed grid (RULER draws a depth per needle), so a heatmap cell is
a (depth, length) pair; a variable-tracking chain starts at the depth and spreads to the
filler's end (RULER spreads it over the whole context); the prompt and answer prefix are
RULER's wording (its "assgined" spelled "assigned"), generation stops at the tokenizer's end
token or after ``eval.generated_tokens`` (RULER: 128 for niah, 30 for vt). A model trained on
the recall task (its own token ids) has the niah tasks only: a fact token per needle, the
asked key's query token at the end, one generated token scored against the answer token.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loongtrain.data.recall import sample_seed
from loongtrain.eval.needles import ADJECTIVES, NOUNS, RecallFormat, TextFormat, needle_offset, snap_back

#: RULER's names for the tasks this evaluation generates.
GENERATED_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt")
#: the tasks a model of the recall task's ids can be asked
RECALL_TASKS = ("niah_single", "niah_multikey")
#: new tokens per answer when eval.generated_tokens is 0 (a value is ~8 tokens; 4 values, 5 names)
DEFAULT_NEW_TOKENS = {"niah_single": 32, "niah_multikey": 32, "niah_multivalue": 64, "vt": 48}
VT_HOPS = 4


@dataclass(frozen=True)
class GeneratedPrompt:
    """One task's pieces before the filler is known: ``inserts`` go into the filler (together
    at the depth, or from it to the end with ``spread``), the model continues after ``tail``,
    ``answers`` are what it should write."""

    head: list[int]
    inserts: list[list[int]]
    tail: list[int]
    answers: tuple[str, ...]  # text tasks: strings found in the answer; recall: the answer token id
    spread: bool = False

    @property
    def fixed_tokens(self) -> int:
        return len(self.head) + sum(map(len, self.inserts)) + len(self.tail)


@dataclass(frozen=True)
class GeneratedContext:
    """One prompt of a generated task: its tokens (ending where the answer starts)."""

    task: str
    length: int
    depth: float
    sample: int
    tokens: list[int]
    answers: tuple[str, ...]
    first_insert: int  # position of the first inserted token


def context_rng(task: str, seed: int, length: int, sample: int) -> random.Random:
    """The generator of one task's keys and values at one (length, sample): the same at every depth."""
    return random.Random(sample_seed("generated", task, seed, length, sample))


def _keys(rng: random.Random, k: int) -> list[str]:
    pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), k)
    return [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]


def _value(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def text_prompt(fmt: TextFormat, task: str, rng: random.Random, needles: int) -> GeneratedPrompt:
    """A text task's prompt in ``fmt``'s tokenizer (and chat template: the instruction, filler
    and question are the user turn, the answer prefix starts the assistant's)."""
    ids = fmt._ids
    if task == "vt":
        names = ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(VT_HOPS + 1)]
        value = _value(rng, 5)
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(VT_HOPS)]
        intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
        prefix = (
            f" Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
            f"are assigned the value {value}, they are: "
        )
        inserts = [ids(f"\n{line}.\n") for line in chain]
        return GeneratedPrompt(fmt.user_open + ids(intro), inserts, ids(question) + fmt.user_close + ids(prefix),
                               tuple(names), spread=True)  # fmt: skip
    if task == "niah_multivalue":
        keys = _keys(rng, 1) * needles
        values = [_value(rng) for _ in range(needles)]
        asked = keys[0]
    else:
        keys = _keys(rng, 1 if task == "niah_single" else needles)
        values = [_value(rng) for _ in keys]
        asked = keys[rng.randrange(len(keys))]
    many = len(keys) > 1
    intro = (
        f"{'Some' if many else 'A'} special magic number{'s are' if many else ' is'} hidden within the following "
        f"text. Make sure to memorize {'them' if many else 'it'}. I will quiz you about the number"
        f"{'s' if many else ''} afterwards.\n"
    )
    inserts = [ids(f"\nOne of the special magic numbers for {key} is: {value}.\n") for key, value in zip(keys, values)]
    if task == "niah_multivalue":
        question = f"\nWhat are all the special magic numbers for {asked} mentioned in the provided text?"
        prefix = f" The special magic numbers for {asked} mentioned in the provided text are"
        answers = tuple(values)
    else:
        question = f"\nWhat is the special magic number for {asked} mentioned in the provided text?"
        prefix = f" The special magic number for {asked} mentioned in the provided text is"
        answers = (values[keys.index(asked)],)
    return GeneratedPrompt(fmt.user_open + ids(intro), inserts, ids(question) + fmt.user_close + ids(prefix), answers)


def recall_prompt(fmt: RecallFormat, task: str, rng: random.Random, needles: int) -> GeneratedPrompt:
    """A niah task in the recall task's ids: fact tokens, one key's query token last."""
    k = 1 if task == "niah_single" else needles
    keys = rng.sample(range(fmt.keys), k)
    values = [rng.randrange(fmt.values) for _ in keys]
    j = rng.randrange(k)
    query0 = fmt.filler + fmt.keys * fmt.values
    inserts = [[fmt.filler + key * fmt.values + value] for key, value in zip(keys, values)]
    return GeneratedPrompt([], inserts, [query0 + keys[j]], (str(query0 + fmt.keys + values[j]),))


def place(
    prompt: GeneratedPrompt, filler: Callable[[int], np.ndarray], length: int, depth: float, task: str, sample: int,
    is_break: Callable[[int], bool] | None = None,
) -> GeneratedContext:  # fmt: skip
    """The prompt of exactly ``length`` tokens: the inserts in ``filler`` at ``depth`` (together,
    or spread evenly from there to the filler's end)."""
    room = length - prompt.fixed_tokens
    if room < 1:
        raise ValueError(
            f"{task}: its needles and question take {prompt.fixed_tokens} tokens, no room for filler in a context of "
            f"{length}; use longer contexts or fewer needles"
        )
    hay = np.asarray(filler(room), dtype=np.int64).tolist()
    at = snap_back(hay, needle_offset(room, depth), is_break)
    if prompt.spread:
        n = len(prompt.inserts)
        cuts = [at + round((room - at) * i / n) for i in range(n)]
        cuts = [snap_back(hay, c, is_break) if i else c for i, c in enumerate(cuts)]
        cuts = [max(c, prev) for prev, c in zip([at, *cuts], cuts)]  # snapping keeps them in order
    else:
        cuts = [at] * len(prompt.inserts)
    body, last = [], 0
    for cut, insert in zip(cuts, prompt.inserts):
        body += hay[last:cut] + insert
        last = cut
    tokens = prompt.head + body + hay[last:] + prompt.tail
    return GeneratedContext(task, length, depth, sample, tokens, prompt.answers, len(prompt.head) + at)


def score(answers: tuple[str, ...], generated: str) -> float:
    """RULER's ``string_match_all``: the fraction of ``answers`` found in ``generated`` (case-insensitive)."""
    text = generated.lower()
    return sum(a.lower() in text for a in answers) / len(answers)
