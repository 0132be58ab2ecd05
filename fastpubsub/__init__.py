"""fastpubsub: publish/subscribe messaging inside PostgreSQL."""

__version__ = "0.1.0"
