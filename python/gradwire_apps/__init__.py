"""gradwire's applications: the ``gradwire`` command line and the distributed demo.

They ship in the gradwire wheel beside the library but are no part of it: ``import gradwire`` never
imports them, and their dependencies (typer, rich, tqdm, scikit-learn, matplotlib and the aggregation
server, gradwire-server) come with the ``apps`` extra: ``pip install 'gradwire[apps]'``.

- :mod:`gradwire_apps.cli`: ``gradwire demo``, ``gradwire serve``;
- :mod:`gradwire_apps.demo`: what ``gradwire demo`` trains and how (tasks, workers, runs, report, plot);
- :mod:`gradwire_apps.gradients`: real gradients of the demo's models, for the benchmarks.
"""

#: How to get what the applications need.
INSTALL_HINT = "pip install 'gradwire[apps]'"
