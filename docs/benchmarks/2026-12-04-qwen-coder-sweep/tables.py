"""The README's tables from this folder's records: speedup against base and against mlx-lm's
loop per draft length, acceptance by position, the 1.5B's verify cost by size beside the
speedup model, peak memory per arm, and each cell's wall time; plus the projection of the
same acceptance where a verify costs one decode step.

    python docs/benchmarks/2026-12-04-qwen-coder-sweep/tables.py [records dir]
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.records import iter_records


def _ci(s: dict, key: str) -> str:
    v, lo, hi = s.get(key), s.get(f"{key}_ci_low"), s.get(f"{key}_ci_high")
    if v is None:
        return "-"
    return f"{v:.3f}x [{lo:.3f}, {hi:.3f}]" if lo is not None else f"{v:.3f}x"


def _name(rec: dict) -> str:
    cell = rec["cell"]
    name = cell["method"].get("label") or cell["method"]["name"]
    ref = cell.get("reference") or "base"
    return name if ref == "base" else f"{name} vs {ref}"


def rows(root: Path) -> list[tuple[dict, dict]]:
    recs = [r for _, r in iter_records(root) if r.get("status") == "ok"]
    return sorted(((r, r["summary"]) for r in recs), key=lambda x: (_name(x[0]), x[0]["cell"]["method"].get(
        "block_size") or 0))


def speed_table(recs) -> str:
    out = ["| arm | draft length | reference tok/s | tok/s | speedup [95% CI: reps] | over prompts [95% CI] | tau | "
           "accepted by position | diverged |", "|---|---|---|---|---|---|---|---|---|"]
    for r, s in recs:
        block = r["cell"]["method"].get("block_size")
        k = block - 1 if block and r["cell"]["method"]["name"] in ("draft_model", "ngram") else "-"
        pos = " ".join(f"{a:.2f}" for a in (s.get("per_position_acceptance") or [])) or "-"
        tau = f"{s['tau']:.2f}" if s.get("tau") is not None else "-"
        out.append(f"| {_name(r)} | {k} | {s['base_decode_tps']:.2f} | {s['decode_tps']:.2f} | {_ci(s, 'speedup')} | "
                   f"{_ci(s, 'speedup_prompts')} | {tau} | {pos} | {s['diverged_prompts']}/{s['prompts']} |")
    return "\n".join(out)


def verify_table(recs) -> str:
    """Verify cost by size (x one decode step) and the speedup model, for draft_model against base."""
    out = ["| draft length | decode ms | verify cost by tokens fed (x decode) | round cost = break-even tau | tau | "
           "predicted | measured | projected at verify = 1 step |", "|---|---|---|---|---|---|---|---|"]
    for r, s in recs:
        cal = r.get("calibration") or {}
        if _name(r) != "draft_model" or not cal:
            continue
        m, decode = s.get("model") or {}, cal["decode_ms"]
        by = " ".join(f"{t}:{ms / decode:.2f}" for t, ms in sorted(cal["verify_ms_by_tokens"].items(),
                                                                    key=lambda x: int(x[0])))
        round_cost, verify = m.get("round_cost_ratio"), m.get("verify_cost_ratio")
        # The same rounds where a verify of any size costs one decode step: the other phases stay.
        projected = s["tau"] / (round_cost - verify + 1) if round_cost and verify else None
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        out.append(f"| {r['cell']['method']['block_size'] - 1} | {decode:.0f} | {by} | {fmt(round_cost, '.2f')} | "
                   f"{s['tau']:.2f} | {fmt(m.get('predicted_speedup'), '.3f')}x | {s['speedup']:.3f}x | "
                   f"{fmt(projected, '.2f')}x |")
    return "\n".join(out)


def memory_table(recs) -> str:
    out = ["| arm | draft length | peak memory, arm (GB) | peak memory, its reference (GB) | cell wall (s): load, "
           "calibrate, timed, profile |", "|---|---|---|---|---|"]
    for r, s in recs:
        block = r["cell"]["method"].get("block_size")
        w = r.get("wall") or {}
        peak, base = s.get("peak_memory_bytes"), s.get("base_peak_memory_bytes")
        gb = lambda b: "-" if not b else f"{b / 1e9:.2f}"  # noqa: E731
        out.append(f"| {_name(r)} | {block - 1 if block else '-'} | {gb(peak)} | {gb(base)} | "
                   f"{r.get('wall_s', 0):.0f}: {w.get('load', 0):.0f}, {w.get('calibrate', 0):.0f}, "
                   f"{w.get('timed_reps', 0):.0f}, {w.get('profile', 0):.0f} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).parent
    recs = rows(root)
    print("## Speed and acceptance\n\n" + speed_table(recs) + "\n\n## Verify cost and the speedup model\n\n"
          + verify_table(recs) + "\n\n## Memory and wall time\n\n" + memory_table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
