
import json, sys, time
mode = sys.argv[1]
print(json.dumps({"type": "ready", "implementation": "fake-" + mode}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    n = req["max_new_tokens"]
    if mode == "stops_short":  # 5 tokens and done, no stop token among them
        n = 5
    if mode == "ends_at_stop":  # 3 tokens, the last a stop id it was sent
        n = 3
    for i in range(n):
        token = req["stop_ids"][0] if mode == "ends_at_stop" and i == n - 1 else 5 + i
        extra = {"drafted": 3, "accepted": 3} if mode == "claims_drafts" else {}
        print(json.dumps({"id": req["id"], "tokens": [token], **extra}), flush=True)
        if mode == "late_done":
            time.sleep(0.02)
    if mode == "late_done":
        time.sleep(0.5)
    print(json.dumps({"id": req["id"], "done": True}), flush=True)
