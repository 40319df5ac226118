"""A data source's identity: what decides its samples, as a small dict (which a checkpoint
records, so a resume on changed data can say what changed) and its 16-hex-digit digest."""

from __future__ import annotations

import hashlib
import json


def data_fingerprint(fields: dict) -> str:
    """16 hex digits of SHA-256 over ``fields`` (JSON, keys sorted): a data config's identity."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def flat_identity(identity: dict, prefix: str = "") -> dict[str, object]:
    """``identity`` with nested dicts flattened to dotted keys (``sources.code.seq_len``)."""
    out: dict[str, object] = {}
    for key, value in identity.items():
        if isinstance(value, dict):
            out.update(flat_identity(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def identity_changes(saved: dict, now: dict, limit: int = 6) -> str:
    """What differs between two identities, in words (``seq_len 64 -> 128, seed 0 -> 1``); a
    token file's header and sampled bytes appear as one ``file content`` entry."""
    a, b = flat_identity(saved), flat_identity(now)
    changed: list[str] = []
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) == b.get(key):
            continue
        head, sep, _ = key.partition("file.")
        if sep and (not head or head.endswith(".")):
            changed.append(f"{head}file content")
        elif key not in a or key not in b:
            changed.append(f"{key} {'added' if key not in a else 'removed'}")
        else:
            changed.append(f"{key} {a[key]} -> {b[key]}")
    changed = list(dict.fromkeys(changed))
    more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
    return ", ".join(changed[:limit]) + more if changed else "nothing that decides the samples"
