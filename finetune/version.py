"""The package version, in a module of its own so any layer can read it without importing the package.

Example:
    from finetune.version import __version__   # '0.1.0'
"""

__version__ = "0.1.0"
