"""``python -m kvplug`` is the ``kvplug`` command."""

from kvplug.cli import main

raise SystemExit(main())
