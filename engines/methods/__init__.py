"""Methods: one module per decoding method, each an Engine (engines/base.py) found by name through
engines/registry.py: base (autoregressive), control, n-gram, draft model, MTP, DFlash, EAGLE-3, and
the device-resident base and protocol of `execution=static` (device.py). A method's drafter network
lives in engines/drafters/, the machinery every method shares in engines/runtime/."""
