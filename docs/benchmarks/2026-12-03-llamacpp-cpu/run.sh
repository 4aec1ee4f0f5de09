#!/usr/bin/env bash
# llama.cpp's server (llama-cpp-python[server], the llamacpp extra) against the harness's base
# decoding of the same packaged GGUF, plain and with prompt lookup; then the report.
set -euo pipefail
O=${O:-docs/benchmarks/2026-12-03-llamacpp-cpu}
G=$(python -c "from harness.models.resolve import named_model_file; print(named_model_file('smollm2'))")
L="python -m llama_cpp.server --model $G --port 8795 --n_ctx 2048"
common=(arch=smollm2 method=server method.url=http://127.0.0.1:8795 bench=real "out_dir=$O")
python -m harness "${common[@]}" arch.dtype=float32 "method.launch='$L'" method.label=llama.cpp
python -m harness "${common[@]}" arch.dtype=float32 method.label=llama.cpp+lookup4 \
  "method.launch='$L --draft_model prompt-lookup-decoding --draft_model_num_pred_tokens 4'"
python -m harness "${common[@]}" arch.gguf_dequantize=false "method.launch='$L'" method.label=llama.cpp
python -m harness arch=smollm2 arch.gguf_dequantize=false method=ngram bench=real "out_dir=$O"
python -m report "$O"
