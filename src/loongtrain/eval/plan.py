"""What an evaluation will do, resolved and checked before any process exists
(:func:`make_plan`), and the contexts it builds from that (:class:`NeedleBuilder`).

Every refusal is one line naming the value and the fix (ConfigError, TokenFileError): a
length the layout does not allow, needles that do not fit a context, a token file too
short for the filler or made with another tokenizer, a missing tokenizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from loongtrain.config import ConfigError, TrainConfig, parse_lengths
from loongtrain.data.tokens import TokenFile, TokenFileError
from loongtrain.eval.generated import (
    DEFAULT_NEW_TOKENS,
    GENERATED_TASKS,
    RECALL_TASKS,
    GeneratedContext,
    GeneratedPrompt,
    place,
    recall_prompt,
    text_prompt,
)
from loongtrain.eval.generated import context_rng as generated_rng
from loongtrain.eval.needles import (
    NeedleContext,
    RecallFormat,
    TextFormat,
    assemble,
    context_rng,
    depth_grid,
    file_filler,
    filler_seed,
)
from loongtrain.model.config import ModelConfig
from loongtrain.train.model_setup import SOURCE_DIR
from loongtrain.train.preflight import TOKENIZER_FILES


@dataclass(frozen=True)
class EvalPlan:
    """A resolved ``[eval]`` section for one model and layout (picklable: plain values)."""

    task: str  # "recall" or "text"
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    needles: int
    samples: int
    seed: int
    max_len: int
    recall: RecallFormat | None  # the recall task's ids (task "recall")
    tokenizer: str  # task "text": where the tokenizer is read from
    chat: bool  # task "text": the prompt inside the tokenizer's chat template
    filler: str  # token file of the needles' filler ("" synthetic)
    loss_file: str  # token file of the loss by position ("" none)
    loss_heldout: bool  # the loss windows are the run's held-out windows of loss_file
    loss_len: int
    loss_windows: int
    buckets: int
    data_seed: int
    generated: tuple[str, ...] = ()  # tasks answered by free generation (eval.generated)
    generated_tokens: dict[str, int] = field(default_factory=dict)  # new tokens per answer, by task

    @property
    def cells(self) -> list[tuple[int, float, int]]:
        """Every context, in order: ``(length, depth, sample)``."""
        return [(n, d, s) for n in self.lengths for d in self.depths for s in range(self.samples)]

    @property
    def chance(self) -> float:
        return self.recall.chance if self.recall is not None else TextFormat.chance

    def describe(self) -> str:
        lengths = ", ".join(map(str, self.lengths))
        what = f"{len(self.cells)} context(s): {lengths} tokens x {len(self.depths)} depth(s)"
        filler = self.filler or ("the recall task's filler" if self.task == "recall" else "RULER's repeated sentences")
        text = f"needles: {self.task}, {self.needles} per context, {what}; filler {filler}"
        if self.loss_windows and self.loss_file:
            kind = "held-out windows of" if self.loss_heldout else "windows of"
            text += f"; loss by position: {self.loss_windows} {kind} {self.loss_len} tokens of {self.loss_file}"
        return text


def find_tokenizer(cfg: TrainConfig, run_dir: Path | None) -> str | None:
    """The model's tokenizer: ``eval.tokenizer``, else ``model.init_from``'s (a Hugging Face folder
    with tokenizer files), else the one a run imported (its source folder); None if none is known."""
    if cfg.eval.tokenizer:
        return cfg.eval.tokenizer
    candidates = [Path(cfg.model.init_from)] if cfg.model.init_from else []
    if run_dir is not None:
        candidates.append(run_dir / SOURCE_DIR)
    for folder in candidates:
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            return str(folder)
    return None


def _resolve_tokenizer(cfg: TrainConfig, run_dir: Path | None) -> str:
    found = find_tokenizer(cfg, run_dir)
    if found is None:
        raise ConfigError(
            "eval.task=text needs a tokenizer for the needle sentences: set eval.tokenizer (a Hugging Face folder or "
            "tokenizer.json), or eval.task=recall for a model trained on the recall task"
        )
    return found


def load_tokenizer(source: str):
    """The tokenizer at ``source``; ConfigError in one line if it cannot be read."""
    from loongtrain.data.tokenizer import make_tokenizer

    try:
        return make_tokenizer(source)
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"eval tokenizer {source!r} cannot be read: {e}") from None


def default_lengths(max_len: int, unit: int) -> tuple[int, ...]:
    """``max_len`` / 8, / 4, / 2 and ``max_len``, each rounded down to a multiple of ``unit``."""
    out = {max(unit, (max_len // f) // unit * unit) for f in (8, 4, 2, 1)}
    return tuple(sorted(n for n in out if n <= max_len))


def check_length(name: str, length: int, unit: int, max_len: int) -> None:
    """Raise ConfigError unless the layout allows a sequence of ``length`` tokens."""
    if length % unit:
        raise ConfigError(
            f"{name}: {length} tokens is not a multiple of 2*hp*cp = {unit} (the layout cuts a sequence into "
            f"2*sp equal chunks); use e.g. {max(unit, length // unit * unit)}"
        )
    if length > max_len:
        raise ConfigError(
            f"{name}: {length} tokens exceeds the longest context this evaluation allows, {max_len} (eval.max_len, "
            f"else the model's context length or data.seq_len); raise eval.max_len or use shorter lengths"
        )


def make_plan(
    cfg: TrainConfig, model: ModelConfig, hp: int, cp: int, run_dir: Path | None = None, task: str | None = None
) -> EvalPlan:
    """Resolve and check ``cfg.eval`` for ``model`` on ``hp x cp`` (no process group); raises
    ConfigError or TokenFileError in one line. ``task`` replaces ``eval.task=auto``'s choice."""
    e, unit = cfg.eval, 2 * hp * cp
    task = e.task if e.task != "auto" else (task or ("recall" if cfg.data.source == "recall" else "text"))
    max_len = e.max_len or model.max_positions or cfg.data.seq_len
    if max_len < unit:
        raise ConfigError(f"eval.max_len={max_len} is shorter than one token per chunk of the layout (2*sp = {unit})")
    lengths = parse_lengths(e.lengths) if e.lengths else default_lengths(max_len, unit)
    for length in lengths:
        check_length("eval.lengths", length, unit, max_len)
    depths = depth_grid(e.depths)
    recall, tokenizer_source, chat, tokenizer = None, "", False, None
    if task == "recall":
        d = cfg.data
        recall = RecallFormat(d.recall_keys, d.recall_values, d.recall_filler)
        if e.needles > recall.keys:
            raise ConfigError(
                f"eval.needles={e.needles} needs as many distinct keys, the recall task has data.recall_keys="
                f"{recall.keys}; use eval.needles <= {recall.keys}"
            )
        if recall.vocab_size > model.vocab_size:
            raise ConfigError(
                f"eval.task=recall needs {recall.vocab_size} token ids, the model's vocabulary is {model.vocab_size}; "
                "use the [data] recall keys the model was trained with, or eval.task=text"
            )
    else:
        tokenizer_source = _resolve_tokenizer(cfg, run_dir)
        tokenizer = load_tokenizer(tokenizer_source)
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if e.chat == "on" and not has_template:
            raise ConfigError(f"eval.chat=on but tokenizer {tokenizer_source} has no chat template; use auto or off")
        chat = e.chat == "on" or (e.chat == "auto" and has_template)
        if tokenizer.vocab_size > model.vocab_size:
            raise ConfigError(
                f"the tokenizer {tokenizer_source} has {tokenizer.vocab_size} ids, the model's vocabulary is "
                f"{model.vocab_size}: not this model's tokenizer; set eval.tokenizer"
            )
    filler = ""
    # the run's token file; a mixture's first source (its held-out tail is that source's held-out data)
    data_file = cfg.data.path or next((source.path for source in cfg.data.sources.values()), "")
    if task == "text":
        filler = e.tokens or (data_file if cfg.data.source == "tokens" else "")
    loss_file, heldout, loss_len = "", False, 0
    if e.loss_windows and task == "text":
        if e.tokens:
            loss_file, loss_len = e.tokens, e.loss_len or max(lengths)
        elif cfg.data.source == "tokens":
            loss_file, heldout, loss_len = data_file, True, cfg.data.seq_len
            if e.loss_len and e.loss_len != cfg.data.seq_len:
                raise ConfigError(
                    f"eval.loss_len={e.loss_len}: the run's held-out windows have data.seq_len={cfg.data.seq_len} "
                    "tokens; set eval.tokens to cut windows of another length from a token file"
                )
        if loss_file:
            check_length("eval.loss_len", loss_len, unit, max(max_len, cfg.data.seq_len if heldout else 0))
    generated = parse_generated(e.generated, task)
    new_tokens = {t: e.generated_tokens or (1 if task == "recall" else DEFAULT_NEW_TOKENS[t]) for t in generated}
    plan = EvalPlan(
        task=task, lengths=tuple(lengths), depths=depths, needles=e.needles, samples=e.samples, seed=e.seed,
        max_len=max_len, recall=recall, tokenizer=tokenizer_source, chat=chat, filler=filler, loss_file=loss_file,
        loss_heldout=heldout, loss_len=loss_len, loss_windows=e.loss_windows if loss_file else 0,
        buckets=e.position_buckets, data_seed=cfg.data.seed, generated=generated, generated_tokens=new_tokens,
    )  # fmt: skip
    _check_files(plan, model, tokenizer)
    builder = NeedleBuilder(plan, tokenizer=tokenizer)
    filler_need = 0
    for length, depth, sample in plan.cells:  # every prompt fits its context (the filler is not read)
        prompt = builder.prompt(length, depth, sample)
        if prompt.fixed_tokens >= length:
            raise ConfigError(
                f"eval: {plan.needles} needle(s) with their question(s) take {prompt.fixed_tokens} tokens, no room "
                f"for filler in a context of {length}; use longer eval.lengths or fewer eval.needles"
            )
        filler_need = max(filler_need, length - prompt.fixed_tokens)
        for name in plan.generated:
            fixed = builder.generated_prompt(name, length, sample).fixed_tokens + plan.generated_tokens[name]
            if fixed >= length:
                raise ConfigError(
                    f"eval.generated {name}: its needles, question and {plan.generated_tokens[name]} new tokens take "
                    f"{fixed} tokens, no room for filler in a context of {length}; use longer eval.lengths, fewer "
                    "eval.needles or a smaller eval.generated_tokens"
                )
    if plan.filler:
        count = TokenFile(plan.filler).count
        if count < filler_need:
            raise TokenFileError(
                f"{plan.filler}: {count} tokens, but the filler of a context of {max(plan.lengths)} needs "
                f"{filler_need}; use a longer token file (eval.tokens) or shorter eval.lengths"
            )
    return plan


def parse_generated(names: str, task: str) -> tuple[str, ...]:
    """The ``eval.generated`` tasks (comma-separated; "all": every one the format has)."""
    allowed = RECALL_TASKS if task == "recall" else GENERATED_TASKS
    if names.strip() == "all":
        return allowed
    found = tuple(dict.fromkeys(n.strip() for n in names.split(",") if n.strip()))
    for name in found:
        if name not in allowed:
            why = " (a model of the recall task's ids has the niah tasks only)" if name in GENERATED_TASKS else ""
            raise ConfigError(f"eval.generated: unknown task {name!r}{why}; choose from {', '.join(allowed)} or all")
    return found


def _check_files(plan: EvalPlan, model: ModelConfig, tokenizer) -> None:
    from loongtrain.data.tokenizer import check_same_tokenizer

    for path in dict.fromkeys(p for p in (plan.filler, plan.loss_file) if p):
        file = TokenFile(path)
        file.check_vocab(model.vocab_size)
        if tokenizer is not None:
            check_same_tokenizer(file, tokenizer)
    if plan.loss_file and not plan.loss_heldout:
        need = (plan.loss_len + 1) * plan.loss_windows
        count = TokenFile(plan.loss_file).count
        if count < need:
            raise TokenFileError(
                f"{plan.loss_file}: {count} tokens cannot give eval.loss_windows={plan.loss_windows} window(s) of "
                f"{plan.loss_len}+1 tokens ({need}); use a longer file, fewer windows or a smaller eval.loss_len"
            )


class NeedleBuilder:
    """Builds the contexts of a plan (the same on every rank: a function of the plan alone)."""

    def __init__(self, plan: EvalPlan, tokenizer=None) -> None:
        self.plan = plan
        self._tokenizer = tokenizer
        if plan.task == "text" and tokenizer is None:
            self._tokenizer = load_tokenizer(plan.tokenizer)

    @property
    def tokenizer(self):
        """The text task's tokenizer (None for the recall task's ids)."""
        return self._tokenizer

    @cached_property
    def format(self) -> RecallFormat | TextFormat:
        if self.plan.recall is not None:
            return self.plan.recall
        return TextFormat(self._tokenizer, self.plan.chat)

    @cached_property
    def _file(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The filler file's tokens (memory-mapped) and document starts, read on first use."""
        if not self.plan.filler:
            return None
        file = TokenFile(self.plan.filler)
        return file.tokens, file.document_starts() if file.knows_documents else None

    def prompt(self, length: int, depth: float, sample: int):
        return self.format.prompt(context_rng(self.plan.seed, length, sample), self.plan.needles)

    def filler(self, length: int, sample: int):
        """The filler of the contexts of one (length, sample) (a function of the token count)
        and the line-break test needles snap to (None: no snapping)."""
        fmt = self.format
        seed = filler_seed(self.plan.seed, length, sample)
        if isinstance(fmt, RecallFormat):
            return fmt.filler_tokens(seed), None
        if self._file is not None:
            return file_filler(*self._file, seed), fmt.is_break
        return fmt.repeat_filler(), fmt.is_break

    def context(self, length: int, depth: float, sample: int) -> NeedleContext:
        filler, is_break = self.filler(length, sample)
        return assemble(self.prompt(length, depth, sample), filler, length, depth, sample, is_break)

    def generated_prompt(self, task: str, length: int, sample: int) -> GeneratedPrompt:
        """A generated task's prompt at one (length, sample): the same at every depth."""
        rng = generated_rng(task, self.plan.seed, length, sample)
        fmt = self.format
        if isinstance(fmt, RecallFormat):
            return recall_prompt(fmt, task, rng, self.plan.needles)
        return text_prompt(fmt, task, rng, self.plan.needles)

    def generated_context(self, task: str, length: int, depth: float, sample: int) -> GeneratedContext:
        """A generated task's prompt for the cell (length, depth, sample): ``length`` tokens less
        the answer's room (as RULER leaves room for generation within the length)."""
        filler, is_break = self.filler(length, sample)
        room = length - self.plan.generated_tokens[task]
        placed = place(self.generated_prompt(task, length, sample), filler, room, depth, task, sample, is_break)
        return dataclasses.replace(placed, length=length)
