"""Built-in prefix caches: ``naive`` (keeps nothing) and ``radix`` (radix tree over pages)."""
