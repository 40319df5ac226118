"""The ``loongtrain`` command: ``loongtrain demo | bench attention | bench memory``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from loongtrain import demo
    from loongtrain.bench import attention as bench_attention
    from loongtrain.bench import memory as bench_memory

    parser = argparse.ArgumentParser(prog="loongtrain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p_demo = commands.add_parser("demo", help="distributed attention on local processes vs full attention")
    demo.add_arguments(p_demo)
    p_demo.set_defaults(run=demo.main)

    p_bench = commands.add_parser("bench", help="benchmarks that print tables")
    benches = p_bench.add_subparsers(dest="bench", required=True)
    p_attn = benches.add_parser("attention", help="scheme times and the ring decomposition overhead")
    bench_attention.add_arguments(p_attn)
    p_attn.set_defaults(run=bench_attention.main)
    p_mem = benches.add_parser("memory", help="peak memory per rank by sp degree, checkpoint mode, ZeRO scope")
    bench_memory.add_arguments(p_mem)
    p_mem.set_defaults(run=bench_memory.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
