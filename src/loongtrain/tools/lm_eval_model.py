"""The ``loongtrain`` model type of lm-evaluation-harness: importing this module registers it
(``lm_eval.simple_evaluate(model="loongtrain", ...)``; ``loongtrain lm-eval`` imports it for
lm-eval's command line).
The model runs on ``nproc`` local ranks (:class:`~loongtrain.eval.server.ModelServer`) with the
parallel layout of the run (or of ``model_args``: ``hp=2,cp=2,ring_window=2``, any config key
as ``parallel.balance=locality``): ``loglikelihood`` and ``loglikelihood_rolling`` are packed
forwards (each request one document), ``generate_until`` is :func:`loongtrain.generate.generate`.

Requests are encoded, truncated and post-processed as lm-eval's ``hf`` model type does them
(the same tokenizer, ``max_length``, prefix token, stop sequences), so the two give the same
numbers on the same weights. Not supported (refused in one line, every request of a batch
checked before any runs; the ranks start at the first request that passes): generation
arguments other than ``until``, ``max_gen_toks``, ``do_sample``, ``temperature``, ``top_p``
and ``seed``, ``think_end_token``, multimodal requests.

Needs the ``lm-eval`` extra (``pip install -e '.[lm-eval]'``; it does not install torch).
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "loongtrain's lm-evaluation-harness model needs lm-eval 0.4.x: pip install -e '.[lm-eval]' "
        f"(or pip install 'lm-eval>=0.4,<0.5'); {e}"
    ) from e

from loongtrain.config import ConfigError
from loongtrain.generate.sampling import Sampling
from loongtrain.tools.lm_eval import config_overrides

DEFAULT_MAX_LENGTH = 2048  # lm-eval's hf default when the model records none


@register_model("loongtrain")
class LoongtrainLM(TemplateLM):
    """A run's checkpoint or a Hugging Face folder on ``nproc`` ranks, for lm-eval."""

    def __init__(
        self, path: str, nproc: int = 1, step: int | None = None, tokenizer: str | None = None,
        max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool | None = None,
        batch_size: int | str = 1, max_batch_size: int | None = None, device: str | None = None, **config,
    ) -> None:  # fmt: skip
        super().__init__()
        from transformers import AutoTokenizer

        from loongtrain.eval.jobs import resolve_target
        from loongtrain.eval.plan import find_tokenizer

        # lm-eval's --device names one device; the ranks take theirs as training does (run.device: auto)
        target = resolve_target(path, config_overrides(config), int(nproc), int(nproc), step=step)
        source = tokenizer or find_tokenizer(target.cfg, target.run_dir)
        if source is None:
            raise ConfigError(f"{path} has no tokenizer: pass model_args tokenizer=FOLDER")
        self.tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        self.tokenizer_source = source
        model = target.spec.model
        self._max_length = int(max_length or model.max_positions or DEFAULT_MAX_LENGTH)
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self._target, self._nproc, self._server = target, int(nproc), None
        self.eos_ids = self._eos_ids(target)

    @property
    def server(self):
        """The model's ranks, started at the first request that passed its checks."""
        if self._server is None:
            from loongtrain.eval.server import ModelServer

            self._server = ModelServer(self._target, self._nproc)
        return self._server

    def _eos_ids(self, target) -> tuple[int, ...]:
        import json

        ids = [self.tokenizer.eos_token_id]
        config = target.path / "generation_config.json"
        if target.hf and config.is_file():
            eos = json.loads(config.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    # -- what lm-eval asks of a model ------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = {} if add_special_tokens is None and self.add_bos_token is None else {
            "add_special_tokens": add_special_tokens if add_special_tokens is not None else self.add_bos_token
        }  # fmt: skip
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        sequences = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]  # as lm-eval's hf truncates
            sequences.append((whole, min(len(continuation), len(whole) - 1)))
        answers = self.server.score(sequences)
        for (pair, _, _), answer in zip(requests, answers):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, counts = [], []
        for (string,) in [req.args for req in requests]:
            rolling = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(self.tok_encode(string), self.prefix_token_id, self.max_length, 1)
            ]
            windows += [(None, *w) for w in rolling]
            counts.append(len(rolling))
        scores = self._loglikelihood_tokens(windows)
        out, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[at : at + n])
            at += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(req.args), total)
        return out

    def _generation(self, req) -> tuple[str, Sampling, tuple[str, ...]]:
        """A generate_until request's context, sampling and stop strings (ConfigError if unsupported)."""
        context, gen_kwargs = req.args
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        new = kwargs.pop("max_gen_toks")
        do_sample, temperature = kwargs.pop("do_sample", False), float(kwargs.pop("temperature", 0.0) or 0.0)
        top_p = kwargs.pop("top_p", None)
        top_p = 1.0 if top_p is None else float(top_p)
        seed = int(kwargs.pop("seed", 0) or 0)
        if kwargs:
            raise ConfigError(f"generate_until: the loongtrain model type does not support {sorted(kwargs)}")
        try:
            sampling = Sampling(
                max_new_tokens=new, temperature=temperature if do_sample else 0.0, top_p=top_p, seed=seed,
                stop_ids=self.eos_ids,
            )  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"generate_until: {e}") from None
        return context, sampling, tuple(until)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        checked = [self._generation(req) for req in requests]  # every request checked before any runs
        out = []
        for req, (context, sampling, until) in zip(requests, checked):
            prompt = self.tok_encode(context)[-(self.max_length - sampling.max_new_tokens) :]
            (tokens,) = self.server.request("generate", ([prompt], sampling, until, self.tokenizer_source))
            text = postprocess_generated_text(self.tok_decode(tokens), list(until), None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit
            pass
