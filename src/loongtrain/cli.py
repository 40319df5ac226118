"""The ``loongtrain`` command: ``train``, ``export``, ``plan``, ``prepare``, ``demo``, and
``bench attention|documents|memory``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from loongtrain import demo
    from loongtrain.bench import attention as bench_attention
    from loongtrain.bench import documents as bench_documents
    from loongtrain.bench import memory as bench_memory
    from loongtrain.data import prepare
    from loongtrain.hf import export
    from loongtrain.planner import cli as plan_cli
    from loongtrain.train import cli as train_cli

    parser = argparse.ArgumentParser(prog="loongtrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p_train = commands.add_parser("train", help="train a model from a TOML config (torchrun or --nproc)")
    train_cli.add_arguments(p_train)
    p_train.set_defaults(run=train_cli.main, takes_extra=True)

    p_export = commands.add_parser("export", help="write a training checkpoint as a Hugging Face model folder")
    export.add_arguments(p_export)
    p_export.set_defaults(run=export.main)

    p_plan = commands.add_parser("plan", help="rank layouts for a cluster, model and length (cost model)")
    plan_cli.add_arguments(p_plan)
    p_plan.set_defaults(run=plan_cli.main)

    p_prep = commands.add_parser("prepare", help="turn text files into a token file")
    prepare.add_arguments(p_prep)
    p_prep.set_defaults(run=prepare.main)

    p_demo = commands.add_parser("demo", help="distributed attention on local processes vs full attention")
    demo.add_arguments(p_demo)
    p_demo.set_defaults(run=demo.main)

    p_bench = commands.add_parser("bench", help="benchmarks that print tables")
    benches = p_bench.add_subparsers(dest="bench", required=True)
    p_attn = benches.add_parser("attention", help="scheme times and the ring decomposition overhead")
    bench_attention.add_arguments(p_attn)
    p_attn.set_defaults(run=bench_attention.main)
    p_docs = benches.add_parser("documents", help="packed documents: work balance and time vs full causal")
    bench_documents.add_arguments(p_docs)
    p_docs.set_defaults(run=bench_documents.main)
    p_mem = benches.add_parser("memory", help="peak memory per rank by sp degree, checkpoint mode, ZeRO scope")
    bench_memory.add_arguments(p_mem)
    p_mem.set_defaults(run=bench_memory.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "takes_extra", False):
        args.run(args, extra)
        return
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
