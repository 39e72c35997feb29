"""``python -m cpdpkit.cli`` is the ``cpdpkit`` command."""

from cpdpkit.cli import main

main()
