"""The harness: config, decode loop, measurement, records, fixtures.

MLX's CUDA backend keeps the cuDNN attention plans it builds in an LRU of 256 entries
(MLX_CUDA_SDPA_CACHE_SIZE), keyed by exact K/V shapes. A speculative round attends
over a new KV length in the verify and in the drafter, so one 128-token generation
asks for ~255 plans: at the default size the last rounds of every generation rebuilt
theirs (~60 ms each on the H200, against ~8 ms for a whole round) in every arm. The
harness raises the size before MLX is first imported (a user's own setting wins) and
records it with the environment.

MLX runs float32 matmuls as TF32 on NVIDIA tensor cores unless MLX_ENABLE_TF32=0 (~1e-3
relative error per product). A float32 run is how the harness proves a method lossless and
its base arm equal to mlx-lm token for token; under TF32 a verify over K+1 rows and a
one-row decode round differently, and on the H200 a qwen35-1b prompt's first token flipped
between two candidates 0.0035 nats apart. So float32 means float32 here (bf16 is unaffected);
a user's own setting wins and lands in the record's `env.mlx_env`.
"""

import os

os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", "8192")
os.environ.setdefault("MLX_ENABLE_TF32", "0")
