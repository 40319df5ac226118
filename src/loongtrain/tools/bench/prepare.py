"""``loongtrain bench prepare``: `loongtrain prepare` on a generated chat JSONL: tokens/s by
worker count and the peak memory (max RSS of the prepare process and its workers, a
*process* figure) by input size, to show it streams.

Records are chat conversations built from real local text (the Python sources of this
interpreter's standard library and site-packages): a user asks about one piece of a file,
the assistant answers with the next. ``--sizes`` files are prefixes of the largest one.

    loongtrain bench prepare --tokenizer TOKENIZER_FOLDER --out /tmp/bench --sizes 50 200 --workers 1 2
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

PIECE_CHARS = 3000


def _sources() -> list[Path]:
    roots = {Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])}
    return sorted(p for root in roots for p in root.rglob("*.py") if p.is_file())


def _pieces(text: str) -> list[str]:
    out, cur, size = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        size += len(line)
        if size >= PIECE_CHARS:
            out.append("".join(cur))
            cur, size = [], 0
    if cur:
        out.append("".join(cur))
    return out


def generate(path: Path, megabytes: int) -> int:
    """Write chat records until ``megabytes`` MB; returns the record count."""
    limit, written, records = megabytes * 10**6, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while True:  # the sources again (a new system prompt) when one pass is not enough
            for src in _sources():
                try:
                    pieces = _pieces(src.read_text(encoding="utf-8"))
                except (UnicodeDecodeError, OSError):
                    continue
                for a, b in zip(pieces[0::2], pieces[1::2]):
                    messages = [
                        {"role": "user", "content": f"What does this part of {src.name} do?\n\n{a}"},
                        {"role": "assistant", "content": b},
                    ]
                    if records % 3 == 0:
                        messages.insert(0, {"role": "system", "content": f"You review Python code (pass {records})."})
                    if records % 4 == 0:
                        messages += [
                            {"role": "user", "content": "And in one line?"},
                            {"role": "assistant", "content": b.strip().splitlines()[0] if b.strip() else "Nothing."},
                        ]
                    line = json.dumps({"messages": messages}, ensure_ascii=False) + "\n"
                    f.write(line)
                    written += len(line.encode("utf-8"))
                    records += 1
                    if written >= limit:
                        return records


def prefix(src: Path, dst: Path, megabytes: int) -> None:
    """The first whole lines of ``src`` up to ``megabytes`` MB."""
    limit, written = megabytes * 10**6, 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        for line in f:
            if written >= limit:
                break
            out.write(line)
            written += len(line)


def run(jsonl: Path, output: Path, tokenizer: str, workers: int) -> dict:
    """One `loongtrain prepare` process; its summary numbers, wall time and max RSS."""
    cmd = [sys.executable, "-m", "loongtrain", "prepare", str(jsonl), "-o", str(output), "--tokenizer", tokenizer]
    cmd += ["--workers", str(workers)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode})")
    first = out.splitlines()[0]
    tokens = int(first.split()[1].replace(",", ""))
    return {
        "wall_s": time.perf_counter() - start,
        "tokens": tokens,
        "tokens_per_s": float(first.split(": ")[-1].split()[0].replace(",", "")),
        "max_rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux: the largest of the process and its workers
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder with a chat template")
    parser.add_argument("--out", default="/tmp/prepare-bench", help="folder for the inputs and token files")
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200], help="input sizes in MB")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare")


def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    largest = out / f"chat-{max(args.sizes)}MB.jsonl"
    if not largest.is_file():
        records = generate(largest, max(args.sizes))
        print(f"generated {largest} ({records:,} records)", flush=True)
    for size in args.sizes:
        if size != max(args.sizes) and not (out / f"chat-{size}MB.jsonl").is_file():
            prefix(largest, out / f"chat-{size}MB.jsonl", size)
    print(f"{'input':>8} {'workers':>7} {'tokens':>12} {'wall s':>8} {'tokens/s':>10} {'max RSS MB':>10}")
    for size in args.sizes:
        for workers in args.workers:
            r = run(out / f"chat-{size}MB.jsonl", out / f"chat-{size}MB-w{workers}.tok", args.tokenizer, workers)
            print(
                f"{size:>6}MB {workers:>7} {r['tokens']:>12,} {r['wall_s']:>8.1f} {r['tokens_per_s']:>10,.0f} "
                f"{r['max_rss_mb']:>10.0f}",
                flush=True,
            )
        files = [out / f"chat-{size}MB-w{w}.tok" for w in args.workers]
        same = all(filecmp.cmp(files[0], f, shallow=False) for f in files[1:])
        print(f"{size:>6}MB token files identical across workers: {same}", flush=True)
