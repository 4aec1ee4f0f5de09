"""The harness: config, decode loop, measurement, records, fixtures.

MLX's CUDA backend keeps the cuDNN attention plans it builds in an LRU of 256 entries
(MLX_CUDA_SDPA_CACHE_SIZE), keyed by exact K/V shapes. A speculative round attends
over a new KV length in the verify and in the drafter, so one 128-token generation
asks for ~255 plans: at the default size the last rounds of every generation rebuilt
theirs (~60 ms each on the H200, against ~8 ms for a whole round) in every arm. The
harness raises the size before MLX is first imported (a user's own setting wins) and
records it with the environment.
"""

import os

os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", "8192")
