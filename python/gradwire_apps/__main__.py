"""``python -m gradwire_apps``: the ``gradwire`` command."""

from .cli import main

main()
