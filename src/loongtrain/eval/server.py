"""A model kept running on N ranks that answers requests one after another: what an
evaluation harness drives (``loongtrain.tools.lm_eval``). The calling process resolves the
target (:func:`~loongtrain.eval.jobs.resolve_target`) and owns the server; the ranks build the
model once, as ``loongtrain eval`` does, then each request runs on all of them (collective:
the 2D / double-ring attention, the sharded K/V cache) and rank 0 answers.

Requests:

- ``score``: ``[(token ids, n), ...]`` -> ``[(log-probability of the last n tokens, all argmax), ...]``
  (:func:`~loongtrain.eval.runner.score_packed`: several sequences per forward, each a document);
- ``generate``: ``(prompts, Sampling, stop strings, tokenizer)`` -> the new tokens of each prompt
  (:func:`~loongtrain.generate.engine.generate`; a stop string in the decoded text ends a prompt).

With data-parallel replicas each takes every dp-th group of the request. One process
(``nproc=1``) runs the model in the calling process itself.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Sequence
from typing import Any

from loongtrain.eval.jobs import Target

#: seconds a request may take before the server is declared dead
REQUEST_TIMEOUT_S = float(os.environ.get("LOONGTRAIN_SERVER_TIMEOUT", "86400"))


class ServerError(RuntimeError):
    """A rank of the model server failed; the message holds its traceback's last line."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """The model and its state on one rank, built once; :meth:`handle` answers one request
    (collective)."""

    def __init__(self, device, target: Target) -> None:
        from loongtrain.eval.model import build_eval_model, load_eval_weights
        from loongtrain.parallel import init_parallel

        cfg, spec = target.cfg, target.spec
        self.state = init_parallel(spec.parallel, device=device, zero_scopes=(cfg.parallel.zero,))
        self.model = build_eval_model(device, cfg, spec, self.state)
        self.loaded = load_eval_weights(self.model, device, target.weights, say=lambda m: None)
        self.budget = cfg.eval.max_len or spec.model.max_positions or cfg.data.seq_len
        self._tokenizers: dict[str, Any] = {}

    def _tokenizer(self, source: str):
        if source not in self._tokenizers:
            from loongtrain.eval.plan import load_tokenizer

            self._tokenizers[source] = load_tokenizer(source)
        return self._tokenizers[source]

    def handle(self, kind: str, payload) -> list:
        from loongtrain.eval.runner import batches, for_my_replica, gather_results, score_packed

        if kind == "score":
            items = list(enumerate(payload))
            groups = batches(items, lambda item: len(item[1][0]), self.budget, mixed=True)

            def score(i: int, group: list) -> list:
                return list(zip([j for j, _ in group], score_packed(self.model, self.state, [s for _, s in group])))

            parts = gather_results(for_my_replica(groups, self.state, score), self.state)
            return [result for _, result in sorted(pair for part in parts for pair in part)]
        if kind == "generate":
            from loongtrain.generate import generate
            from loongtrain.generate.sampling import stop_at_strings

            prompts, sampling, stops, source = payload
            stop_when = stop_at_strings(self._tokenizer(source), stops) if stops else None

            def run(i: int, group: list) -> list:
                done = generate(self.model, self.state, [p for _, p in group], sampling, stop_when=stop_when)
                return list(zip([j for j, _ in group], done.tokens))

            groups = [[(i, p)] for i, p in enumerate(prompts)]  # one prompt per prefill, as HF's batch of one
            parts = gather_results(for_my_replica(groups, self.state, run), self.state)
            return [tokens for _, tokens in sorted(pair for part in parts for pair in part)]
        raise ValueError(f"unknown request {kind!r}")


def _serve(rank: int, world: int, port: int, env, target: Target, jobs, results) -> None:
    """A server rank: build the model, then answer requests until ``None``."""
    import torch.distributed as dist

    from loongtrain.launch import allow_ctrl_c, apply_environment, init_distributed, local_rank_env

    allow_ctrl_c()
    apply_environment(env)
    local_rank_env(rank, world, port)
    try:
        device = init_distributed(timeout_s=max(600.0, target.cfg.run.timeout_s * 2), device=target.cfg.run.device)
        ranks = Ranks(device, target)
        if rank == 0:
            results.put(("ready", ranks.loaded))
        while True:
            job = jobs.get()
            if job is None:
                break
            answer = ranks.handle(*job)
            if rank == 0:
                results.put(("ok", answer))
    except BaseException as e:  # noqa: BLE001 - reported to the caller, which raises
        results.put(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class ModelServer:
    """``target`` on ``nproc`` local ranks (forked from the launcher's fork server), answering
    :meth:`request` calls until :meth:`close`."""

    def __init__(self, target: Target, nproc: int) -> None:
        self.nproc, self._local = nproc, None
        if nproc == 1:
            from loongtrain.launch import init_distributed, single_process_env

            single_process_env()
            device = init_distributed(device=target.cfg.run.device)
            self._local = Ranks(device, target)
            self.loaded = self._local.loaded
            return
        import multiprocessing

        from loongtrain.launch import environment_changes, start_method, start_worker_server

        start_worker_server(["loongtrain.eval.server"])
        ctx = multiprocessing.get_context(start_method())
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(nproc)]
        port, env = _free_port(), environment_changes()
        self._procs = [
            ctx.Process(target=_serve, args=(r, nproc, port, env, target, self._jobs[r], self._results), daemon=True)
            for r in range(nproc)
        ]
        for p in self._procs:
            p.start()
        self.loaded = self._answer()

    def _answer(self):
        while True:
            try:
                kind, value = self._results.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.close()
                    raise ServerError(
                        f"model server rank(s) {dead} ended without an answer (started from a Python script, the "
                        "ranks import it as multiprocessing's forkserver does: keep its work under "
                        '`if __name__ == "__main__":`)'
                    ) from None
                continue
            if kind == "error":
                self.close()
                raise ServerError(value)
            return value

    def request(self, kind: str, payload) -> list:
        """Run one request on every rank; rank 0's answer."""
        if self._local is not None:
            return self._local.handle(kind, payload)
        for q in self._jobs:
            q.put((kind, payload))
        return self._answer()

    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
        return self.request("score", [(list(ids), n) for ids, n in sequences])

    def close(self) -> None:
        """Stop the ranks (or this process's group)."""
        if self._local is not None:
            import torch.distributed as dist

            from loongtrain.launch import clear_single_process_env

            if dist.is_initialized():
                dist.destroy_process_group()
            clear_single_process_env()
            self._local = None
            return
        for q in getattr(self, "_jobs", []):
            q.put(None)
        for p in getattr(self, "_procs", []):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._procs = []
