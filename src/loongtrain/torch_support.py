"""The PyTorch releases loongtrain is tested on, and the check that refuses an older one.

Tested: torch 2.13 on Python 3.11 (the development machines, every test) and torch 2.11 on
Python 3.12 (the GPU machine's image: the unit and dist subsets and the GPU check's CPU
paths, ``scripts/check_gpu_image.sh``). Older releases lack APIs loongtrain uses (FSDP2's
custom collectives and hooks, the selective-checkpoint contexts as called here), so they are
refused with one line rather than failing somewhere inside a step. No torch import here.
"""

from __future__ import annotations

import re

#: the oldest (major, minor) release that is tested; pyproject.toml states the same
OLDEST_TESTED = (2, 11)
TESTED = "2.11 (Python 3.12) and 2.13 (Python 3.11)"


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``2.11.0+cu130`` or ``2.12.0a0+git``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def check_torch(version: str | None = None) -> None:
    """Raise RuntimeError (one line naming the fix) if ``version`` (default: the installed
    torch's) is older than :data:`OLDEST_TESTED`."""
    if version is None:
        import torch

        version = torch.__version__
    if release(version) < OLDEST_TESTED:
        oldest = ".".join(map(str, OLDEST_TESTED))
        raise RuntimeError(
            f"loongtrain needs torch >= {oldest} (tested: {TESTED}); this is torch {version}: "
            f"pip install 'torch>={oldest}'"
        )
