"""Example third-party kvplug plugin providing the ``page-hash`` prefix cache."""

__version__ = "0.1.0"
