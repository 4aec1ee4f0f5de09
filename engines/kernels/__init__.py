"""Custom kernels and per-backend recurrences: small-M matmuls (gemm), one-token attention over a
static buffer (live_attention), the Gated DeltaNet recurrence (deltanet). Each has a CPU path or is
a no-op where its backend is absent."""
