"""A receipt for people: the few lines a terminal shows instead of the receipt JSON.

``format_summary(receipt)`` reads only what receipt format 2 guarantees, plus
what the collection's playbooks put in ``result.operation`` (units and their
readiness, the artifact path); anything missing is left out, never guessed.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

READINESS = (("ttr_port_open_s", "port open"), ("ttr_http_ready_s", "HTTP ready"), ("ttft_s", "TTFT"))
WIDTH = 100


def format_duration(seconds: Any) -> str:
    """``0.84 s``, ``11.40 s``, ``3 min 07 s``, ``1 h 02 min``; ``-`` for a missing value."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.2f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def _seconds(value: Any) -> str | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.3f} s"
    return None


def readiness_text(readiness: Any) -> str:
    """``port open 0.137 s, HTTP ready 0.247 s, TTFT 0.262 s`` (the measures present)."""
    if not isinstance(readiness, Mapping):
        return ""
    parts = [f"{label} {text}" for key, label in READINESS if (text := _seconds(readiness.get(key)))]
    return ", ".join(parts)


def _unit_state(unit: Mapping[str, Any]) -> str:
    state = unit.get("state")
    if isinstance(state, str) and state:
        return state
    if unit.get("ok") is False:
        return "failed"
    if unit.get("warm"):
        return "warm"
    return "ok" if unit.get("ok") else "-"


def unit_rows(receipt: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(unit, host, state, readiness text) for every unit the operation's result names."""
    op = ((receipt.get("result") or {}).get("operation")) if isinstance(receipt.get("result"), Mapping) else None
    if not isinstance(op, Mapping):
        return []
    rows: list[tuple[str, str, str, str]] = []
    units = op.get("units")
    if isinstance(units, list):
        for u in units:
            if isinstance(u, Mapping) and isinstance(u.get("unit"), str):
                text = readiness_text(u.get("readiness"))
                served = u.get("served")
                if isinstance(served, Mapping) and u.get("listeners_moved"):  # restored onto another port
                    where = f"serving {served.get('address')}:{served.get('port')}"
                    text = f"{where}, {text}" if text else where
                rows.append((u["unit"], str(u.get("host") or "-"), _unit_state(u), text))
    if rows:
        return rows
    # capture: the acceptance evidence carries each unit's readiness, the capsules their state.
    acceptance = op.get("acceptance")
    evidence = acceptance.get("evidence") if isinstance(acceptance, Mapping) else None
    capsules = op.get("capsules")
    capsule_state = {c["unit"]: c.get("state") for c in (capsules if isinstance(capsules, list) else [])
                     if isinstance(c, Mapping) and isinstance(c.get("unit"), str)}
    if isinstance(evidence, Mapping):
        for uid, raw in evidence.items():
            ev = raw if isinstance(raw, Mapping) else {}
            state = capsule_state.get(uid) or "captured"
            rows.append((str(uid), str(ev.get("host") or "-"), str(state), readiness_text(ev.get("readiness"))))
    elif capsule_state:
        rows.extend((uid, "-", str(state or "captured"), "") for uid, state in capsule_state.items())
    return rows


def _wrap(label: str, text: str) -> list[str]:
    pad = " " * 12
    lines = textwrap.wrap(text, width=WIDTH - len(pad), break_long_words=False, break_on_hyphens=False) or [""]
    return [f"  {label:<10}{lines[0]}"] + [pad + line for line in lines[1:]]


def format_summary(receipt: Mapping[str, Any], *, receipt_path: str | Path | None = None) -> str:
    """The human summary of a receipt (several lines, no trailing newline)."""
    result = receipt.get("result") if isinstance(receipt.get("result"), Mapping) else {}
    runner = result.get("runner") if isinstance(result.get("runner"), Mapping) else {}
    op = result.get("operation") if isinstance(result.get("operation"), Mapping) else {}
    state = str(receipt.get("state") or "?")
    if runner.get("cancelled"):
        state += " (cancelled)"
    verb = str(receipt.get("operation") or "?") + (" --prepare-only" if receipt.get("prepare_only") else "")
    head = f"coldsnap {verb} {receipt.get('operation_id', '?')}: {state}"
    if receipt.get("state") != "running":
        head += f" in {format_duration(receipt.get('duration_seconds'))}"
    lines = [head]
    started = receipt.get("started_at")
    if started:
        completed = f"  (completed {receipt['completed_at']})" if receipt.get("completed_at") else ""
        lines.append(f"  {'started':<10}{started}{completed}")
    if receipt.get("engine") or receipt.get("snapshot_driver"):
        chosen = (receipt.get("result") or {}).get("snapshot_driver_selection") or {}
        how = f", chosen: {chosen['chosen_by']}" if isinstance(chosen, dict) and chosen.get("chosen_by") else ""
        lines.append(f"  {'engine':<10}{receipt.get('engine') or '-'} (snapshot driver "
                     f"{receipt.get('snapshot_driver') or '-'}{how})")
    rows = unit_rows(receipt)
    if rows:
        w_unit = max(len(f"{u} @ {h}") for u, h, _s, _r in rows)
        w_state = max(len(s) for _u, _h, s, _r in rows)
        for i, (unit, host, ustate, ready) in enumerate(rows):
            label = "units" if i == 0 else ""
            line = f"  {label:<10}{f'{unit} @ {host}':<{w_unit}}  {ustate:<{w_state}}"
            lines.append((line + (f"  {ready}" if ready else "")).rstrip())
    if isinstance(op.get("pending"), list) and op["pending"]:
        lines.append(f"  {'pending':<10}{', '.join(map(str, op['pending']))} (a later wake finishes them)")
    if isinstance(op.get("state"), str) and not rows:
        lines.append(f"  {'workload':<10}{op['state']}")
    if isinstance(op.get("artifact"), str):
        lines.append(f"  {'artifact':<10}{op['artifact']}")
        if op.get("capture_id"):
            lines.append(f"  {'capture':<10}{op['capture_id']}"
                         + (f" (generation {op['generation']})" if op.get("generation") is not None else ""))
    error = receipt.get("error")
    if isinstance(error, Mapping) and error.get("message"):
        lines.extend(_wrap("error", str(error["message"])))
        where = []
        if error.get("phase"):
            where.append(f"phase {error['phase']!r}")
        if error.get("task"):
            where.append(f"task {error['task']!r}")
        if error.get("host"):
            where.append(f"on {error['host']}")
        if where:
            lines.append(f"  {'where':<10}{' '.join(where)}")
    elif receipt.get("state") == "failed":
        lines.append(f"  {'error':<10}(the receipt records no error message)")
    for key, label in (("unreachable_hosts", "unreachable"), ("failed_hosts", "failed on")):
        hosts = result.get(key)
        if isinstance(hosts, list) and hosts:
            lines.append(f"  {label:<10}{', '.join(map(str, hosts))}")
    warnings = result.get("controller_warnings")
    if isinstance(warnings, list) and warnings:
        lines.append(f"  {'warnings':<10}{len(warnings)} controller warning(s): see the receipt's "
                     "result.controller_warnings")
    if receipt_path is not None:
        lines.append(f"  {'receipt':<10}{receipt_path}")
    return "\n".join(lines)
