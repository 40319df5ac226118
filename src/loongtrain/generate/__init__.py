"""Generation on the training layout: prefill with the 2D / double-ring attention, a K/V
cache sharded as the sequence is, and decoding whose partial attention results merge by
their log-sum-exp across the ranks.

- :mod:`~loongtrain.generate.cache`: which tokens each rank keeps (pure), the per-rank cache,
  the decode attention's local part and its merges;
- :mod:`~loongtrain.generate.sampling`: greedy, temperature and top-p, stop tokens;
- :mod:`~loongtrain.generate.engine`: :func:`~loongtrain.generate.engine.generate`.
"""

from loongtrain.generate.engine import Generation, generate
from loongtrain.generate.sampling import Sampling

__all__ = ["Generation", "Sampling", "generate"]
