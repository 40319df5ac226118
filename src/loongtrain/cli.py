"""The ``loongtrain`` command: the subcommands of :data:`COMMANDS` and the benchmarks of
:data:`BENCHES` (``loongtrain bench NAME``).

Each command's module is imported only when that command runs (or shows its help), so
``loongtrain plan`` does not pay for torch.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import signal
import sys
import textwrap
import threading

from loongtrain.local_workers import start_worker_server
from loongtrain.torch_support import check_torch

# command -> (module with add_arguments/main, one-line help, main takes the unparsed extra args)
COMMANDS: dict[str, tuple[str, str, bool]] = {
    "train": ("loongtrain.train.cli", "train a model from a TOML config (torchrun or --nproc)", True),
    "eval": ("loongtrain.eval.cli", "needle retrieval grid and loss by position of a checkpoint or HF folder", True),
    "generate": ("loongtrain.generate.cli", "generate from prompts with a checkpoint or HF folder on N ranks", True),
    "lm-eval": ("loongtrain.tools.lm_eval", "lm-evaluation-harness with the loongtrain model type", True),
    "export": ("loongtrain.train.export", "write a training checkpoint as a Hugging Face model folder", False),
    "plan": ("loongtrain.plan_cli", "rank layouts for a cluster, model and length (cost model)", False),
    "prepare": ("loongtrain.data.prepare", "tokenize text, chat or prompt+completion records into a token file", False),
    "data-inspect": (
        "loongtrain.train.data_inspect",
        "what a config's token files feed: source shares, long documents, lengths, repeats (no model, no GPU)",
        True,
    ),
    "demo": ("loongtrain.tools.demo", "distributed attention on local processes vs full attention", False),
    "gpu-check": ("loongtrain.tools.gpucheck.check", "every device path vs float64, overhead, MFU: one table", False),
}
BENCHES: dict[str, tuple[str, str]] = {
    "attention": ("loongtrain.tools.bench.attention", "scheme times and the ring decomposition overhead"),
    "documents": ("loongtrain.tools.bench.documents", "packed documents: work balance and time vs full causal"),
    "memory": ("loongtrain.tools.bench.memory", "peak memory per rank by sp degree, checkpoint mode, ZeRO scope"),
    "train": ("loongtrain.tools.bench.train", "the trainer's step: eager vs compiled, time breakdown; vs transformers"),
    "prepare": ("loongtrain.tools.bench.prepare", "prepare on generated chats: tokens/s by workers, memory by size"),
    "eval": ("loongtrain.tools.bench.eval", "the evaluation's forward vs a training step: tokens/s at the same length"),
    "generate": ("loongtrain.tools.bench.generate", "generation: prefill vs forward, decode, cache; vs transformers"),
    "data": ("loongtrain.tools.bench.data", "the loader: ms to draw a step of long sequences, one file vs a mixture"),
    "guard": ("loongtrain.tools.bench.guard", "the guard and per-source losses: host reads and step time vs without"),
    "layer-kinds": ("loongtrain.tools.bench.layer_kinds", "bytes per step of a sliding layer vs a full one, cp 4/8"),
}


def _train(args: argparse.Namespace, extra: list[str]) -> None:
    """``loongtrain train``: the trainer, with the ``[eval]`` section's evaluations before the
    first step and after the steps it names. Wired here: the trainer knows nothing of evaluation."""
    from loongtrain.eval import training as evaluation
    from loongtrain.train import cli as train_cli

    train_cli.main(args, extra, after_step=evaluation.after_step, check=evaluation.check)


#: commands whose ``main`` is wired here from more than their module
WIRED = {"train": _train}
#: modules a command's workers import besides its own (the fork server imports them once)
WORKER_IMPORTS = {"train": ["loongtrain.eval.training"]}


#: what ``loongtrain --help`` says above the commands (plain text, one sentence)
DESCRIPTION = (
    "Train, evaluate and plan LLMs on long sequences across many devices (LoongTrain's 2D head-context parallelism)."
)


def _help_width() -> int:
    """The width argparse wraps its help to (the terminal's, less 2)."""
    return max(shutil.get_terminal_size().columns - 2, 44)


def _listing(title: str, rows: list[tuple[str, str]]) -> str:
    """``rows`` of (name of up to 18 characters, one-line help) under ``title``, laid out like
    argparse's list of commands: the help from column 24, wrapped as argparse wraps."""
    lines = [title]
    for name, help in rows:
        first, *rest = textwrap.wrap(help, _help_width() - 24)
        lines += [f"    {name:18s}  {first}", *(" " * 24 + line for line in rest)]
    return "\n".join(lines)


def _top_help() -> tuple[str, str]:
    """The description and epilog of ``loongtrain --help``: one sentence, then the benchmarks
    (argparse lists the commands itself, but not the commands under ``bench``)."""
    benches = _listing("benchmarks (loongtrain bench NAME):", [(f"bench {n}", h) for n, (_, h) in BENCHES.items()])
    epilog = f"{benches}\n\nEach command's options: loongtrain COMMAND --help."
    return textwrap.fill(DESCRIPTION, _help_width()), epilog


def _register(subparsers, name: str, module: str, help: str, load: bool, run=None, **defaults) -> None:
    parser = subparsers.add_parser(name, help=help, description=help)
    if load:  # only the command being run imports its module
        mod = importlib.import_module(module)
        mod.add_arguments(parser)
        parser.set_defaults(run=run or mod.main, **defaults)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``loongtrain`` parser; only the command named in ``argv`` gets its options
    (``None``: every command, which imports every command's module)."""
    chosen = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    description, epilog = _top_help()
    parser = argparse.ArgumentParser(
        prog="loongtrain", description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, title="commands")
    for name, (module, help, takes_extra) in COMMANDS.items():
        load = argv is None or name == chosen
        _register(commands, name, module, help, load, WIRED.get(name), takes_extra=takes_extra)
    bench_help = "benchmarks that print tables (listed below)"
    p_bench = commands.add_parser("bench", help=bench_help, description="Benchmarks that print tables.")
    benches = p_bench.add_subparsers(dest="bench", required=True, title="benchmarks")
    rest = argv[argv.index("bench") + 1 :] if argv is not None and chosen == "bench" else []
    bench = next((a for a in rest if not a.startswith("-")), None)
    for name, (module, help) in BENCHES.items():
        # a bench that takes config keys (--section.key value) gets the arguments it does not know
        _register(benches, name, module, help, argv is None or name == bench, takes_extra=name in BENCH_CONFIG_KEYS)
    return parser


#: benchmarks that take config keys (``--parallel.cp 4``) besides their own arguments
BENCH_CONFIG_KEYS = ("generate",)
#: bench -> options with which it runs in this process alone (starts no workers)
BENCH_IN_PROCESS = {"train": ("--peer", "--profile")}
#: benchmarks that always run in this process alone
BENCH_NO_WORKERS = ("data",)
#: Commands that run local worker processes (``bench``: every benchmark but those).
LAUNCHES = ("train", "eval", "generate", "demo", "gpu-check", "bench")
HELP = ("-h", "--help", "--help-config")


def _worker_modules(argv: list[str]) -> list[str] | None:
    """The modules the workers of the command in ``argv`` import (its own), or None when it
    starts no workers (another command, or asking for help)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] not in LAUNCHES or any(a in HELP for a in argv):
        return None
    if words[0] == "bench":
        if len(words) > 1 and words[1] in BENCH_NO_WORKERS:
            return None
        alone = BENCH_IN_PROCESS.get(words[1], ()) if len(words) > 1 else ()
        if any(a.split("=")[0] in alone for a in argv):  # no workers: no server importing beside the timings
            return None
        return [BENCHES[words[1]][0]] if len(words) > 1 and words[1] in BENCHES else None
    return [COMMANDS[words[0]][0], *WORKER_IMPORTS.get(words[0], [])]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    modules = _worker_modules(argv)
    if modules is not None:  # the fork server imports torch and the command beside this process
        start_worker_server(modules)
    try:
        parser = _holding_ctrl_c(build_parser, argv)  # imports the command's module (torch, for most): seconds
        args, extra = parser.parse_known_args(argv)
        if "torch" in sys.modules:  # the command runs on torch (the planner does not)
            try:
                check_torch()
            except RuntimeError as e:
                print(f"loongtrain: {e}", file=sys.stderr)
                raise SystemExit(2) from None
        if getattr(args, "takes_extra", False):
            args.run(args, extra)
            return
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.run(args)
    except KeyboardInterrupt:  # a command that has more to say about a Ctrl-C says it itself
        command = " ".join(["loongtrain", *[a for a in argv if not a.startswith("-")][:1]])
        print(f"{command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def _holding_ctrl_c(fn, *args):
    """``fn(*args)`` with a Ctrl-C held until it returns, then raised as KeyboardInterrupt.

    Importing torch runs C++ initialisers; a KeyboardInterrupt raised inside one of them
    aborts the process with a C++ message ("terminate called after throwing an instance of
    'pybind11::error_already_set'", measured with a Ctrl-C 0.5 s after start). A Python-level
    handler that only records the signal never raises there."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    pressed: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:  # started with Ctrl-C ignored (nohup, `cmd &`): keep it so
        return fn(*args)
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        result = fn(*args)
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
