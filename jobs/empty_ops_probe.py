import subprocess, sys
OPS = {
 "matmul": "e @ w.T",
 "linear": "nn.Linear(8, 16)(e)",
 "rmsnorm": "nn.RMSNorm(8)(e)",
 "concat": "mx.concatenate([e, x], axis=1)",
 "sdpa_kv_empty_concat": "mx.fast.scaled_dot_product_attention(q, mx.concatenate([e4, k], axis=2), mx.concatenate([e4, k], axis=2), scale=1.0)",
 "rope": "nn.RoPE(8)(e4)",
 "slice_update": "mx.slice_update(mx.zeros((1, 10, 8)), e, mx.array([3]), axes=(1,))",
}
pre = "import mlx.core as mx, mlx.nn as nn; x = mx.random.normal((1,5,8)); w = mx.random.normal((16,8)); e = x[:, :0]; k = mx.random.normal((1,2,4,8)); q = mx.random.normal((1,2,4,8)); e4 = k[:, :, :0]; "
for name, op in OPS.items():
    r = subprocess.run([sys.executable, "-c", pre + f"y = {op}; mx.eval(y); print(y.shape)"], capture_output=True, text=True)
    print(name, r.returncode, (r.stdout + r.stderr).strip().splitlines()[-1:] if (r.stdout + r.stderr).strip() else "")
