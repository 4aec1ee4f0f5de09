"""The harness's exception classes, in a leaf module that imports nothing.

The schema (harness/config.py), the GGUF importer and tokenizer, the model and prompt
loaders and the trainer all raise these; living here, they cost their importers no cycle."""


class ConfigError(ValueError):
    """Bad user input: the message names the problem and the fix."""


class GGUFError(ConfigError):
    """A GGUF file this importer cannot convert faithfully; the message names file and fix."""


class TargetError(ValueError):
    """A target checkpoint's files cannot be loaded; the message names the file and what is wrong.
    Not a ConfigError: the input was valid, the checkpoint is damaged, and the cell is recorded."""
