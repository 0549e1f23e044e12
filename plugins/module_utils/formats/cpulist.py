"""CPU lists as the kernel writes them (``Cpus_allowed_list``, ``taskset -c``, cpusets): ``0-2,5``.

Used by the capture evidence's thread pins (``process/affinity.py``) and by the reference engine's
``--bind-cpus``.
"""

from __future__ import annotations

# Far above any CPU count Linux supports (CONFIG_NR_CPUS tops out at 8192): a list naming more is
# not a CPU list.
MAX_CPU = 1 << 16


def format_cpus(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the kernel's ``Cpus_allowed_list`` form)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpus(text: str, *, what: str = "CPU list") -> frozenset[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}``; anything else is refused (it comes from a capture's evidence)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what} must be a non-empty string such as '0-3,8', not {text!r}")
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, sep, hi = part.partition("-")
        if not all(x.isascii() and x.isdigit() for x in ((lo, hi) if sep else (lo,))):
            raise ValueError(f"{what} {text!r}: {part!r} is not a CPU number or range")
        a = int(lo)
        b = int(hi) if sep else a
        if not a <= b < MAX_CPU:
            raise ValueError(f"{what} {text!r}: {part!r} is not a CPU number or an ascending range")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)
