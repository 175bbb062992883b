"""Errors that reach users as one clear line (the CLI maps them to exit code 2)."""


class MixlensError(ValueError):
    """Bad input or an unsupported request; the message is shown to the user as is."""


class ReconstructionError(RuntimeError):
    """A decomposition did not sum back to the real module output (names the layer)."""
