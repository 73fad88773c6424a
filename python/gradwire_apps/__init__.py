"""gradwire's applications: the ``gradwire`` command line and the distributed demo.

They ship in the gradwire wheel beside the library but are no part of it: ``import gradwire`` never
imports them, and their dependencies (typer, rich, tqdm, scikit-learn, matplotlib and the aggregation
server, gradwire-server) come with the ``apps`` extra. gradwire-server is on no registry: pip takes it from
a checkout's ``./server`` (``make install`` does both). :func:`install_hint` says exactly what to install
for what is missing, from where: never ``pip install 'gradwire[apps]'`` alone, which fails (pip would look
for gradwire-server on PyPI).

- :mod:`gradwire_apps.cli`: ``gradwire demo``, ``gradwire serve``;
- :mod:`gradwire_apps.demo`: what ``gradwire demo`` trains and how (tasks, workers, runs, report, plot);
- :mod:`gradwire_apps.gradients`: real gradients of the demo's models, for the benchmarks.
"""

#: The PyPI distribution of each module the applications import, where the names differ.
PYPI_NAMES = {"sklearn": "scikit-learn"}


def install_hint(modules) -> str:
    """The command that installs ``modules`` (import names), each from where it can be had: the PyPI ones in
    one ``pip install``, gradwire-server from a gradwire checkout."""
    modules = list(modules)
    pypi = [PYPI_NAMES.get(m, m) for m in modules if m != "gradwire_server"]
    parts = [f"pip install {' '.join(pypi)}"] if pypi else []
    if "gradwire_server" in modules:
        parts.append("pip install ./server from a gradwire checkout (gradwire-server is on no registry)")
    return "; ".join(parts)
