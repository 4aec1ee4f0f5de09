"""Measurement script of this folder (run on the device, not part of the package): per window, device busy time, idle gaps, kernel counts and the top kernels per round."""
import json, re, sys, collections
trace, wins = sys.argv[1], json.load(open(sys.argv[2]))
K, A = [], []
for line in open(trace, errors="replace"):
    parts = line.rstrip("\n").split(" ", 5)
    if len(parts) < 6: continue
    kind, s, e, corr, stream, name = parts
    (K if kind in "KM" else A).append((int(s), int(e), int(corr), name))
K.sort(); A.sort()
def short(n):
    n = re.sub(r"<.*", "", n); return n[:60]
for w in wins:
    ks = [k for k in K if w["start"] <= k[0] < w["end"]]
    api = [a for a in A if w["start"] <= a[0] < w["end"]]
    span = (w["end"] - w["start"]) / 1e3
    busy, cur_s, cur_e = 0, None, None
    for s, e, _, _ in ks:
        if cur_e is None or s > cur_e:
            if cur_e is not None: busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else: cur_e = max(cur_e, e)
    if cur_e is not None: busy += cur_e - cur_s
    r = max(1, w["rounds"])
    by = collections.defaultdict(lambda: [0, 0])
    for s, e, _, n in ks:
        by[short(n)][0] += e - s; by[short(n)][1] += 1
    apis = collections.defaultdict(lambda: [0, 0])
    for s, e, _, n in api:
        apis[n][0] += e - s; apis[n][1] += 1
    print(f"\n== {w['arm']} rep {w['rep']}: {w['rounds']} rounds, window {span/1e3:.1f} ms, "
          f"{span/r:.1f} us/round, busy {busy/1e3/r:.1f} us/round ({100*busy/1e3/span:.0f}%), "
          f"{len(ks)/r:.0f} kernels/round")
    for n, (t, c) in sorted(by.items(), key=lambda x: -x[1][0])[:18]:
        print(f"   {t/1e3/r:8.1f} us/round {c/r:6.1f}x  {n}")
    print("   api:", ", ".join(f"{n} {c/r:.1f}x {t/1e3/r:.0f}us" for n, (t, c) in sorted(apis.items(), key=lambda x: -x[1][0])[:6]))
