"""The package version, in a module of its own so low layers (the manifest) can read it without importing
the package's public API (and with it everything else).

Example:
    from finetune.version import __version__
"""

__version__ = "0.1.0"
