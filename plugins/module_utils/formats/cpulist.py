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
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [c]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def parse_cpus(text: str, *, what: str = "CPU list") -> frozenset[int]:
    """``"0-2,5"`` -> ``{0, 1, 2, 5}``; anything else is refused (it comes from a capture's evidence)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what} must be a non-empty string such as '0-3,8', not {text!r}")
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{what} {text!r}: {part!r} is not a CPU number or range") from None
        if not 0 <= a <= b < MAX_CPU or not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{what} {text!r}: {part!r} is not a CPU number or an ascending range")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)
