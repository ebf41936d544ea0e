"""The warning ``liger_rt.patch`` gives (a module of its own: the light package ``__init__`` and core both need it)."""


class PatchWarning(UserWarning):
    """A default-on layer was left on the host path (kernel module or HF class missing)."""
