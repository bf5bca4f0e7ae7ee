"""How much RAM this process may still take, for sizing what it allocates up front
(the engine's KV tiers, a replay's block pools): the kernel's MemAvailable,
or less inside a container whose cgroup limit is lower.  No torch, no psutil.
"""

from __future__ import annotations

import os


def available_ram() -> int:
    """RAM this process may still take: the machine's available memory, or less
    inside a container whose cgroup limit is lower (a pod's memory limit)."""
    available = mem_available()
    room = cgroup_room()
    return min(available, room) if room is not None else available


def mem_available(meminfo_path: str = "/proc/meminfo") -> int:
    """The kernel's MemAvailable (free memory plus reclaimable page cache); free
    pages alone where /proc/meminfo is missing.  (psutil reads the same line, but
    is no run-time dependency: the image would size its tiers differently.)"""
    try:
        with open(meminfo_path, encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# cgroup v2, then v1: (limit file, usage file, stat file, its inactive page cache line).
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
     "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"),
)


def cgroup_room(files=_CGROUP_FILES) -> int | None:
    """The memory cgroup's limit minus its working set; None without a limit.

    Usage counts the page cache too (the weights just read, a conversion just
    written); its inactive part is reclaimed before the limit bites, so it is
    room (the kubelet's working set leaves it out the same way)."""
    for limit_file, usage_file, stat_file, inactive_key in files:
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        inactive = 0
        try:
            with open(stat_file) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == inactive_key:
                        inactive = int(value)
                        break
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - max(0, usage - inactive))
    return None
