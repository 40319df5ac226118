"""Long-context retrieval chats made from the Python standard library's sources, no download.

Each record's user turn holds several source files of the standard library (whole modules,
or a run of whole top-level statements of one that is larger than the room left) and then asks
for one short, exact piece of one of them:

- ``docstring``: the first line of a function's, method's or class's docstring;
- ``signature``: the ``def`` line of a function or method;
- ``constant``: the line that assigns a module-level constant.

The assistant answers with exactly that text, which occurs verbatim in the user turn, so the
loss falls on a few assistant tokens after a long context. A module's split is fixed by a
hash of its path (one in ten is ``eval``), not by the seed, so train and eval records of any
seeds never share a module. Lengths are measured with ``--tokenizer`` (a Hugging Face
tokenizer folder, through its chat template when it has one, or a ``tokenizer.json``
file), else estimated at 4 characters per token. The records depend on the Python version
whose standard library is read (``--source`` reads another folder of sources).

    .venv/bin/python scripts/make_chat_data.py -o runs/chat/train.jsonl --tokenizer runs/smollm2-135m-instruct
    .venv/bin/python scripts/make_chat_data.py -o runs/chat/eval.jsonl --split eval --count 20 --tokenizer ...
    .venv/bin/python scripts/make_chat_data.py -o runs/chat/short.jsonl --max-tokens 2048  # quick CPU runs

``--format prompt-completion`` writes ``{"prompt": system + user text, "completion": answer}``
instead of ``{"messages": [...]}``; the records are the same for the same seed. ``--keep-meta``
keeps each record's ``meta`` (question kind and name, files, tokens).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import random
import re
import statistics
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("train", "eval")
EVAL_ONE_IN = 10  # one module in ten (by path hash) is held out for eval
# folders of the standard library that hold tests, data tables, generated or vendored code
SKIPPED_DIRS = frozenset({
    "test", "tests", "idlelib", "lib2to3", "turtledemo", "pydoc_data", "encodings", "ensurepip",
    "site-packages", "dist-packages", "lib-dynload", "__pycache__", "__phello__",
})  # fmt: skip
MAX_ANSWER_CHARS = 120
MIN_ANSWER_CHARS = 8
CHARS_PER_TOKEN = 4  # the estimate without a tokenizer
SYSTEM = (
    "You answer questions about the Python source files the user gives you. Reply with the requested text "
    "exactly as it is written in the files, and nothing else."
)
QUESTIONS = {
    "docstring": "In `{path}`, what is the first line of the docstring of `{name}`? "
    "Reply with that line exactly as it is written, and nothing else.",
    "signature": "In `{path}`, what is the `def` line of `{name}`? "
    "Reply with that line exactly as it is written (without its indentation), and nothing else.",
    "constant": "In `{path}`, which line assigns the module-level constant `{name}`? "
    "Reply with that line exactly as it is written, and nothing else.",
}
KINDS = tuple(QUESTIONS)
CONSTANT_NAME = re.compile(r"^_?[A-Z][A-Z0-9_]+$")


@dataclass(frozen=True)
class Question:
    kind: str
    name: str  # function, Class.method or constant name
    answer: str
    block: int  # the top-level statement (block) that must be in the context


@dataclass
class Module:
    path: str  # relative to the source folder, with "/"
    lines: list[str]  # with their line ends
    blocks: list[tuple[int, int]]  # [start, end) line ranges, one per top-level statement, covering the file
    questions: list[Question]
    block_tokens: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(self.block_tokens)

    def text(self, lo: int, hi: int) -> str:
        """The source of blocks ``lo`` .. ``hi - 1``, ending with a newline."""
        text = "".join(self.lines[self.blocks[lo][0] : self.blocks[hi - 1][1]])
        return text if text.endswith("\n") else text + "\n"


def split_of(path: str) -> str:
    """``eval`` for one module path in ``EVAL_ONE_IN`` (by SHA-256, the same on every machine), else ``train``."""
    return "eval" if int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % EVAL_ONE_IN == 0 else "train"


def source_files(root: Path) -> list[str]:
    """The ``.py`` files under ``root`` (relative paths, sorted), without tests, data tables and vendored code."""
    found = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if set(parts[:-1]) & SKIPPED_DIRS or parts[0].startswith("config-") or parts[-1].startswith("_sysconfigdata"):
            continue
        found.append(p.relative_to(root).as_posix())
    return sorted(found)


def _stores(tree: ast.AST) -> Counter:
    return Counter(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))


def _scope_names(body: list[ast.stmt]) -> Counter:
    """How often each function or class name is defined in a scope, through its if/try/with/
    for/while/match blocks but not in nested functions or classes."""
    names: Counter = Counter()
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] += 1
            continue
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            stack.extend(getattr(node, name, None) or [])
    return names


def _def_questions(node, qualname: str, lines: list[str], block: int) -> list[Question]:
    out = []
    def_line = lines[node.lineno - 1].strip()
    if def_line.startswith(("def ", "async def ")) and def_line.endswith(":"):  # the signature on one line
        out.append(Question("signature", qualname, def_line, block))
    doc = ast.get_docstring(node, clean=True)
    if doc and doc.strip():
        first = doc.strip().splitlines()[0].strip()
        body = "".join(lines[node.lineno - 1 : node.end_lineno])
        if first in body:  # not when escapes or line continuations change the text
            out.append(Question("docstring", qualname, first, block))
    return out


def parse_module(root: Path, path: str) -> Module | None:
    """``path``'s source split into top-level statements, and the questions it can answer
    (None if it cannot be read or parsed)."""
    try:
        text = (root / path).read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    lines = text.splitlines(keepends=True)
    if not tree.body or not lines:
        return None
    starts = [0]
    for node in tree.body[1:]:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
        if first > starts[-1]:
            starts.append(first)
    blocks = list(zip(starts, [*starts[1:], len(lines)]))
    block_of = {}
    for node in tree.body:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
        block_of[id(node)] = max(i for i, (lo, _) in enumerate(blocks) if lo <= first)

    # a name defined twice in its scope (property setters, overloads, conditional definitions) is ambiguous
    questions: list[Question] = []
    stores, module_names = _stores(tree), _scope_names(tree.body)
    for node in tree.body:
        block = block_of[id(node)]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and module_names[node.name] > 1:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            questions += _def_questions(node, node.name, lines, block)
        elif isinstance(node, ast.ClassDef):
            questions += [q for q in _def_questions(node, node.name, lines, block) if q.kind == "docstring"]
            class_names = _scope_names(node.body)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and class_names[item.name] == 1:
                    questions += _def_questions(item, f"{node.name}.{item.name}", lines, block)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.lineno == node.end_lineno:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name) and node.value is not None:
                name = targets[0].id
                line = lines[node.lineno - 1].strip()
                if CONSTANT_NAME.match(name) and stores[name] == 1 and line.startswith(name) and ";" not in line:
                    questions.append(Question("constant", name, line, block))
    questions = [q for q in questions if MIN_ANSWER_CHARS <= len(q.answer) <= MAX_ANSWER_CHARS]
    return Module(path, lines, blocks, questions)


class TokenCounter:
    """Token counts: a Hugging Face tokenizer folder (its chat template for whole records when
    it has one), a ``tokenizer.json`` file, or ``None`` (4 characters per token)."""

    def __init__(self, tokenizer: str | None) -> None:
        self.name = tokenizer
        self._hf = self._json = None
        if tokenizer is None:
            return
        if Path(tokenizer).is_file():
            from tokenizers import Tokenizer

            self._json = Tokenizer.from_file(tokenizer)
        else:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
            self._hf.model_max_length = sys.maxsize  # counting only: no warning about the model's context

    @property
    def estimated(self) -> bool:
        return self._hf is None and self._json is None

    def counts(self, texts: list[str]) -> list[int]:
        if self._hf is not None:
            return [len(ids) for ids in self._hf(texts, add_special_tokens=False)["input_ids"]]
        if self._json is not None:
            return [len(e.ids) for e in self._json.encode_batch(texts, add_special_tokens=False)]
        return [math.ceil(len(t) / CHARS_PER_TOKEN) for t in texts]

    def record(self, record: dict) -> int:
        """The tokens of a record as written: a chat through the template (when there is one)."""
        if "messages" in record and self._hf is not None and self._hf.chat_template:
            return self.counts([self._hf.apply_chat_template(record["messages"], tokenize=False)])[0]
        if "messages" in record:
            return sum(self.counts([m["content"] for m in record["messages"]])) + 5 * len(record["messages"])
        return sum(self.counts([record["prompt"], record["completion"]]))


@dataclass
class Part:
    module: Module
    lo: int  # blocks lo .. hi - 1
    hi: int

    @property
    def tokens(self) -> int:
        return sum(self.module.block_tokens[self.lo : self.hi])

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == len(self.module.blocks)

    def header(self, i: int, n: int) -> str:
        where = self.module.path
        if not self.whole:
            lo, hi = self.module.blocks[self.lo][0] + 1, self.module.blocks[self.hi - 1][1]
            where += f", lines {lo}-{hi} of {len(self.module.lines)}"
        return f"=== File {i} of {n}: {where} ===\n"

    def questions(self) -> list[Question]:
        return [q for q in self.module.questions if self.lo <= q.block < self.hi]


def excerpt(module: Module, room: int, rng: random.Random) -> Part | None:
    """A run of whole top-level statements of ``module`` of at most ``room`` tokens, from a
    random start, or None when no statement fits."""
    starts = [i for i, t in enumerate(module.block_tokens) if t <= room]
    if not starts:
        return None
    lo = hi = rng.choice(starts)
    used = 0
    while hi < len(module.blocks) and used + module.block_tokens[hi] <= room:
        used += module.block_tokens[hi]
        hi += 1
    while lo > 0 and used + module.block_tokens[lo - 1] <= room:
        lo -= 1
        used += module.block_tokens[lo]
    return Part(module, lo, hi)


class Generator:
    """Records of one split, deterministic for a seed (and Python's standard library)."""

    def __init__(self, root: Path, split: str, counter: TokenCounter, seed: int) -> None:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        self.root, self.counter = root, counter
        self.paths = [p for p in source_files(root) if split_of(p) == split]
        if not self.paths:
            raise ValueError(f"no {split} modules (.py files) under {root}")
        self.rng = random.Random(f"{seed}:{split}")
        self._modules: dict[str, Module | None] = {}
        self._order: list[str] = []

    def module(self, path: str) -> Module | None:
        if path not in self._modules:
            module = parse_module(self.root, path)
            if module is not None:
                module.block_tokens = self.counter.counts([module.text(i, i + 1) for i in range(len(module.blocks))])
            self._modules[path] = module
        return self._modules[path]

    def _next_path(self) -> str:
        if not self._order:  # a new pass over the split's modules, in a new order
            self._order = self.rng.sample(self.paths, len(self.paths))
        return self._order.pop()

    def _parts(self, budget: int) -> list[Part]:
        parts: list[Part] = []
        used, tries = 0, 0
        min_piece = max(64, budget // 20)
        while budget - used >= min_piece and tries < 4 * len(self.paths):
            tries += 1
            path = self._next_path()
            module = self.module(path)
            if module is None or any(p.module.path == path for p in parts):
                continue
            room = budget - used
            part = Part(module, 0, len(module.blocks)) if module.tokens <= room else excerpt(module, room, self.rng)
            if part is None or part.tokens < min(min_piece, module.tokens):
                continue
            parts.append(part)
            used += part.tokens
        return parts

    def record(self, min_tokens: int, max_tokens: int, prompt_completion: bool, tries: int = 20) -> tuple[dict, int]:
        """One record and its token count, between ``min_tokens`` and ``max_tokens``."""
        overhead = self.counter.counts([SYSTEM + QUESTIONS["signature"]])[0] + 60  # framing, template, answer
        for _ in range(tries):
            target = self.rng.randint(min_tokens, max_tokens)
            parts = self._parts(max(target - overhead, 1))
            askable = [p for p in parts if p.questions()]
            if not askable:
                continue
            self.rng.shuffle(parts)
            kind = self.rng.choice(sorted({q.kind for p in askable for q in p.questions()}))  # kinds evenly
            part = self.rng.choice([p for p in askable if any(q.kind == kind for q in p.questions())])
            q = self.rng.choice([q for q in part.questions() if q.kind == kind])
            files = "".join(p.header(i + 1, len(parts)) + p.module.text(p.lo, p.hi) for i, p in enumerate(parts))
            user = (
                f"Below are {len(parts)} source file(s) from the Python standard library.\n\n{files}"
                f"=== End of files ===\n\n{QUESTIONS[q.kind].format(path=part.module.path, name=q.name)}"
            )
            assert q.answer in user, (part.module.path, q)
            if prompt_completion:
                record = {"prompt": f"{SYSTEM}\n\n{user}", "completion": q.answer}
            else:
                record = {"messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": q.answer},
                ]}  # fmt: skip
            tokens = self.counter.record(record)
            if min_tokens <= tokens <= max_tokens:
                record["meta"] = {
                    "kind": q.kind, "name": q.name, "file": part.module.path,
                    "files": [p.module.path for p in parts], "tokens": tokens,
                }  # fmt: skip
                return record, tokens
        raise RuntimeError(
            f"could not make a record of {min_tokens}-{max_tokens} tokens in {tries} tries from the "
            f"{len(self.paths)} modules of this split; widen the range (a few hundred tokens is the least that works)"
        )


def generate(
    root: Path, split: str, count: int, min_tokens: int, max_tokens: int, seed: int,
    counter: TokenCounter, prompt_completion: bool = False,
) -> list[dict]:  # fmt: skip
    """``count`` records of ``split`` (each with a ``meta`` entry: question kind, files, tokens)."""
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"need 0 < --min-tokens <= --max-tokens, got {min_tokens} and {max_tokens}")
    gen = Generator(root, split, counter, seed)
    return [gen.record(min_tokens, max_tokens, prompt_completion)[0] for _ in range(count)]


def write_jsonl(records: list[dict], output: Path, keep_meta: bool) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r if keep_meta else {k: v for k, v in r.items() if k != "meta"}, ensure_ascii=False))
            f.write("\n")
    partial.replace(output)


def summary(records: list[dict], counter: TokenCounter) -> str:
    """Records, token lengths, question kinds, files per record and answer lengths, as text."""
    unit = "tokens (estimated, 4 characters each)" if counter.estimated else f"tokens ({counter.name})"
    lengths = sorted(r["meta"]["tokens"] for r in records)
    answers = counter.counts([r["completion"] if "completion" in r else r["messages"][-1]["content"] for r in records])

    def pct(q: float) -> int:
        return lengths[min(len(lengths) - 1, int(q * len(lengths)))]

    kinds = Counter(r["meta"]["kind"] for r in records)
    files = [len(r["meta"]["files"]) for r in records]
    modules = {f for r in records for f in r["meta"]["files"]}
    return "\n".join([
        f"records: {len(records)}; {unit} per record: min {lengths[0]}, p10 {pct(0.1)}, median {pct(0.5)}, "
        f"mean {statistics.fmean(lengths):.0f}, p90 {pct(0.9)}, max {lengths[-1]}",
        f"questions: {', '.join(f'{k} {kinds[k]}' for k in KINDS)}; answer tokens: mean "
        f"{statistics.fmean(answers):.1f}, max {max(answers)}",
        f"files per record: min {min(files)}, mean {statistics.fmean(files):.1f}, max {max(files)}; "
        f"{len(modules)} distinct modules",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--split", choices=SPLITS, default="train", help="module split (eval: 1 in 10 modules)")
    parser.add_argument("--count", type=int, default=100, help="records to write")
    parser.add_argument("--max-tokens", type=int, default=20000, help="longest record, in tokens")
    parser.add_argument("--min-tokens", type=int, default=None, help="shortest record (default 60%% of --max-tokens)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder or tokenizer.json (default: chars/4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=("messages", "prompt-completion"), default="messages")
    parser.add_argument("--source", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="folder of Python sources (default: this Python's standard library)")  # fmt: skip
    parser.add_argument("--keep-meta", action="store_true", help="keep each record's 'meta' entry (kind, files)")
    args = parser.parse_args(argv)
    min_tokens = args.min_tokens if args.min_tokens is not None else args.max_tokens * 3 // 5
    counter = TokenCounter(args.tokenizer)
    try:
        records = generate(args.source, args.split, args.count, min_tokens, args.max_tokens, args.seed, counter,
                           prompt_completion=args.format == "prompt-completion")  # fmt: skip
    except (ValueError, RuntimeError) as e:
        sys.exit(f"make_chat_data: {e}")
    write_jsonl(records, args.output, args.keep_meta)
    print(f"wrote {args.output} ({args.format}, split {args.split}, seed {args.seed}, source {args.source})")
    print(summary(records, counter))


if __name__ == "__main__":
    main()
