"""Defaults shared by the ``kvplug`` sub-commands, so that ``capacity`` plans the pool ``serve`` builds.

A leading underscore keeps this module from being discovered as a sub-command.
"""

# tokens per KV page: the page size hosts run with (SGLang and vLLM default to 16 on GPU too)
DEFAULT_PAGE_SIZE = 16
