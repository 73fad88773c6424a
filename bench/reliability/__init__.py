"""Reliability probes: each ``probe_<topic>.py`` module measures one family of hazards on a real server or
decoder and reports rows of (probe, expected, observed, passed). ``python -m bench.reliability`` (``make
reliability``) runs every module and writes docs/results/reliability.md."""
