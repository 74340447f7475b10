"""The kernel's CPU counters as linserve reads them: /proc/stat's per-CPU busy time, a process's /proc/<pid>/stat.
Torch-free: the frontend's metrics read them too (a frontend process never imports torch)."""

from __future__ import annotations

import os

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat's columns after the CPU's name; busy = all but idle and iowait (guest time is inside user already)
STAT_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
IDLE_COLUMNS = (3, 4)


def cpus_busy_seconds(stat_text: str, cpus: frozenset[int]) -> float:
    """Busy seconds of `cpus` since boot, from /proc/stat's `cpuN` lines."""
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in rest.split()[: len(STAT_COLUMNS)]]
        ticks += sum(v for i, v in enumerate(values) if i not in IDLE_COLUMNS)
    return ticks / TICKS_PER_S


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the name (field 3, the state, first; the name in parentheses may hold
    spaces); None where the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_seconds(self_stat_text: str) -> float:
    """utime + stime of /proc/<pid>/stat (fields 14 and 15; the name in parentheses may hold spaces)."""
    fields = self_stat_text.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S
