import json, re, sys
# usage: python round.py <trace.txt> <windows.json> <arm> <rep> <round>: one round's host calls and kernel bursts
trace, wins = sys.argv[1], json.load(open(sys.argv[2]))
arm, rep, rnd = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
w = next(x for x in wins if x["arm"] == arm and x["rep"] == rep)
K, A = [], []
for line in open(trace, errors="replace"):
    p = line.rstrip("\n").split(" ", 5)
    if len(p) < 6: continue
    s = int(p[1])
    if not (w["start"] <= s < w["end"]): continue
    (K if p[0] in "KM" else A).append((s, int(p[2]), int(p[3]), p[5]))
K.sort(); A.sort()
# round boundaries: the host sync calls
syncs = [a for a in A if "EventSynchronize" in a[3]]
print(len(syncs), "syncs;", len(A), "api;", len(K), "kernels")
names = {}
def short(n):
    n = re.sub(r"^_ZN3mlx4core2cu\d+", "", n); n = re.sub(r"^custom_kernel_harness_", "", n)
    return re.sub(r"I13__nv_bfloat16.*|Ev.*|_bfloat1.*", "", n)[:28]
# take the window between sync rnd and rnd+1
t0, t1 = syncs[rnd][1], syncs[rnd + 1][1]
ev = [(a[0], a[1], "H", a[3]) for a in A if t0 <= a[0] < t1 and "AddKernelNode" not in a[3] and "AddChild" not in a[3]] + \
     [(k[0], k[1], "G", short(k[3])) for k in K if t0 <= k[0] < t1]
ev.sort()
prev = None; run = []
def flush():
    if run:
        print(f"  G {(run[0][0]-t0)/1e3:8.1f} +{(run[-1][1]-run[0][0])/1e3:6.1f}us  {len(run):3d} kernels  busy {sum(e-s for s,e,_,_ in run)/1e3:6.1f}  {' '.join(r[3] for r in run[:8])} ...")
for e in ev:
    if e[2] == "G":
        if run and e[0] - run[-1][1] > 3000:
            flush(); run = []
        run.append(e)
    else:
        flush(); run = []
        print(f"H {(e[0]-t0)/1e3:8.1f} +{(e[1]-e[0])/1e3:6.1f}us  {e[3]}")
flush()
print("round", (t1 - t0) / 1e3, "us")
print("---- 250us buckets: api calls (AddKernelNode / other), GPU busy us")
import collections
B = 250_000
nb = (t1 - t0) // B + 1
add = collections.Counter(); oth = collections.Counter(); busy = collections.Counter(); launch = collections.Counter()
for a in A:
    if t0 <= a[0] < t1:
        b = (a[0] - t0) // B
        if "AddKernelNode" in a[3] or "AddChild" in a[3]: add[b] += 1
        elif "GraphLaunch" in a[3]: launch[b] += 1
        else: oth[b] += 1
for k in K:
    if t0 <= k[0] < t1:
        busy[(k[0] - t0) // B] += (k[1] - k[0]) / 1e3
for b in range(nb):
    print(f"{b*B/1e3:7.0f} add {add[b]:4d} launch {launch[b]} other {oth[b]:3d} busy {busy[b]:6.1f}")
