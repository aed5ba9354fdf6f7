"""How much host memory this process may still take: what a buffer allocated at start
(the KV slot pool) is checked against, so that a size that cannot fit is refused with a
line that says what fits, not a numpy traceback or an out-of-memory kill later (numpy's
zeros are lazy: an oversized pool may allocate and then fail as it is written)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What the cgroup (v2) limit leaves: memory.max less memory.current; None unlimited."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def available_memory() -> int | None:
    """Bytes of host memory available now (the kernel's MemAvailable, within a cgroup's
    limit); None where neither can be read."""
    sizes = [s for s in (_meminfo_available(), _cgroup_room()) if s is not None]
    if not sizes and hasattr(os, "sysconf"):
        with contextlib.suppress(OSError, ValueError):
            sizes.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(sizes) if sizes else None


def size_text(size: float) -> str:
    """Bytes in binary units, e.g. "2.98 TiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"
