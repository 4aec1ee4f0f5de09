"""The engines' exception classes, in a leaf module that imports nothing.

Engines, drafter loaders, the harness and the trainer raise and catch these; living here
rather than beside the protocol (engines/base.py), they cost their importers no cycle."""


class Unsupported(Exception):
    """This method cannot run on this model/config; the message says why."""


class DrafterError(ValueError):
    """A drafter checkpoint does not fit its target (the message says which field or tensor)."""
