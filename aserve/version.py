"""aserve's version (one place: the package, the CLI and GET /version read it)."""

__version__ = "0.1.0"
