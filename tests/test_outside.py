"""Outside engines over the subprocess protocol (engines/outside.py): the mlx-lm adapter in
examples/ gives base's tokens with its own timings, and an engine that will not start, starts
too slowly, writes garbage or dies mid-cell gives an `error` record naming what happened while
the sweep goes on."""

import subprocess
import sys
import textwrap

import pytest

from harness.fixtures import fixture_dir
from tests.test_cli import REPO, harness, records

SMOKE = ["arch=llama", "arch.dtype=float32", "bench=smoke", "bench.max_prompts=2", "bench.max_new_tokens=16",
         "bench.reps=2"]


def test_the_mlx_lm_adapter_gives_base_tokens_with_its_own_timings(tmp_path):
    cmd = f"{sys.executable} {REPO / 'examples' / 'mlx_lm_adapter.py'} --model {fixture_dir('llama')} --dtype float32"
    r = harness("method=subprocess", f"method.command='{cmd}'", *SMOKE, f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "ok", rec.get("reason")
    s = rec["summary"]
    assert s["diverged_prompts"] == 0 and s["tokens"] == 2 * 16  # the adapter's greedy tokens are base's
    assert s["ttft_ms"] > 0 and s["decode_tps"] > 0 and s["base_decode_tps"] > 0 and len(s["speedup_reps"]) == 2
    e = rec["engine"]
    assert e["implementation"].startswith("mlx_lm.generate_step") and e["protocol"] == "subprocess JSON lines"
    assert "examples/mlx_lm_adapter.py" in e["command"] and "inferred" in e["observed"]


ENGINES = {  # a broken engine each, and what its error record must say
    "exits_at_start": ("import sys; sys.stderr.write('no weights here\\n'); sys.exit(3)",
                       ["exited with code 3", "no weights here"]),
    "slow_to_start": ("import time; time.sleep(30)", ["took longer than 2 s to start"]),
    "garbage": ("""
        import json, sys
        print(json.dumps({"type": "ready"}), flush=True)
        for line in sys.stdin:
            print("tokens: 1 2 3", flush=True)
        """, ["malformed line", "tokens: 1 2 3"]),
    "dies_mid_cell": ("""
        import json, sys
        print(json.dumps({"type": "ready"}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            print(json.dumps({"id": req["id"], "tokens": [5]}), flush=True)
            sys.stderr.write("segfault in verify\\n")
            sys.exit(4)
        """, ["exited with code 4", "segfault in verify"]),
}


@pytest.mark.parametrize("kind", list(ENGINES))
def test_a_broken_engine_gives_an_error_record_naming_it_and_the_sweep_goes_on(tmp_path, kind):
    source, expected = ENGINES[kind]
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(source))
    out = tmp_path / "out"
    r = harness("method=subprocess,base", f"method.command='{sys.executable} {script}'",
                "method.startup_timeout_s=2", "method.request_timeout_s=20", *SMOKE, f"out_dir={out}", "-m")
    assert r.returncode != 0  # a sweep with an error cell says so
    recs = {rec["cell"]["method"]["name"]: rec for rec in records(out).values()}
    assert recs["base"]["status"] == "ok"  # the next cell ran
    bad = recs["subprocess"]
    assert bad["status"] == "error" and all(x in bad["reason"] for x in expected), bad["reason"]
    assert str(script) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout  # stopped
