"""What every method runs on: the target and its caches (target, cache, static), exact rollback, tree
verify (tree), acceptance and sampling on the device (sampling, forced), prefix reuse (prefix), reading a
target's internals (hidden), checkpoint files (checkpoint, torch_bin, shared_weights), CUDA dispatch
choices (dispatch) and every temporary library patch (patches)."""
