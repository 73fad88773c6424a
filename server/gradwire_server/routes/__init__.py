"""One router per resource: health (and metrics), runs, nodes, state, updates."""
