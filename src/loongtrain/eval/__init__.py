"""Long-context evaluation: the needle retrieval grid (depth x length, exact match of the
answer tokens, the effective context) and the loss by position, on the layouts of
training (``loongtrain eval``; the ``[eval]`` section during ``loongtrain train``).

- :mod:`~loongtrain.eval.needles`: needle contexts (recall-task ids or tokenized text), pure;
- :mod:`~loongtrain.eval.positions`: log-spaced position buckets and held-out windows, pure;
- :mod:`~loongtrain.eval.plan`: the resolved ``[eval]`` section and its one-line refusals;
- :mod:`~loongtrain.eval.runner`: one forward per sequence on the sp group, results gathered;
- :mod:`~loongtrain.eval.model`: the forward-only model and its weights (checkpoint, HF, random);
- :mod:`~loongtrain.eval.report`: tables, JSON, heatmap and curve;
- :mod:`~loongtrain.eval.cli` (``loongtrain eval``) and :mod:`~loongtrain.eval.training`
  (the hook and check ``loongtrain train`` runs for ``[eval]``).
"""
