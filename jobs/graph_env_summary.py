"""One line per setting and dispatch variant of a graph-env.jsonl (jobs/graph_env.py): the Target's
median costs in ms, to read at a glance between device calls.

    python jobs/graph_env_summary.py graph-env.jsonl
"""

import json
import sys

from harness.faults import guarded

COSTS = ("step", "step_pipelined", "verify_2", "verify_8", "verify_16", "tree_16", "tree_16_bool_mask")


def main(path: str) -> None:
    print("setting | variant | " + " ".join(COSTS) + " | build step/verify_16/tree_16")
    for line in open(path):
        row = json.loads(line)
        variants = {"default": row, **{k: v for k, v in row.items() if k.startswith("stable=")}}
        for name, v in variants.items():
            builds = "/".join(str(v.get(f"build_{k}", "-")) for k in ("step", "verify_16", "tree_16"))
            print(f"{row['label']} | {name} | " + " ".join(str(v.get(k, "-")) for k in COSTS) + f" | {builds}")
        for method, r in row.get("rounds", {}).items():  # --methods: phase host/whole ms, then the round
            phases = " ".join(f"{k} {r['host_ms'][k]}/{ms}" for k, ms in r["phase_ms"].items())
            print(f"{row['label']} | {method} rounds | {phases} | round {r['round_ms']}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python jobs/graph_env_summary.py graph-env.jsonl")
    sys.exit(guarded(lambda: main(sys.argv[1]), "jobs/graph_env_summary.py"))
