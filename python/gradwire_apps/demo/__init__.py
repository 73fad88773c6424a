"""The distributed demo behind ``gradwire demo``, one module per concern (imported on demand):

- :mod:`~gradwire_apps.demo.tasks`: the data sets and models, and the tasks the workers train;
- :mod:`~gradwire_apps.demo.worker`: one training node as its own process
  (``python -m gradwire_apps.demo.worker``);
- :mod:`~gradwire_apps.demo.runs`: one distributed run — the run on the server and its worker processes;
- :mod:`~gradwire_apps.demo.report`: the table of results; :mod:`~gradwire_apps.demo.plot`: the plot;
- :mod:`~gradwire_apps.demo.driver`: the main job, both runs side by side (:func:`run_demo`).

Nothing is imported here, so that a worker process loads only what it uses.
"""
