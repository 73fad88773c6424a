"""The knobs of ``gradwire demo`` (a plain dataclass, so the command line reads them without loading the demo)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_RUNS", "MODELS", "RUNS", "DemoSettings"]

#: What ``gradwire demo --model`` can train (the keys of :data:`gradwire_apps.demo.tasks.TASKS`, named here
#: so that the command line can offer them without importing the tasks' dependencies).
MODELS = ("digits", "transformer")
#: The runs ``gradwire demo`` can make, in the order the table shows them.
RUNS = ("sparseloco", "demo", "dense", "panthalia")
DEFAULT_RUNS = ("sparseloco", "demo", "dense")


@dataclass
class DemoSettings:
    """The knobs of ``gradwire demo`` (defaults sized for a couple of minutes on two cores)."""

    model: str = "digits"
    workers: int = 8
    steps: int = 320  # per node, in every run (SparseLoCo: local steps, steps / sync_every versions)
    hidden: int | None = None  # the task's default width
    batch_size: int = 32  # per node per step
    # Learning rates: the best of a grid on this task at 320 steps, 8 nodes (dense over 1e-3, 3e-3, 1e-2;
    # SparseLoCo's inner over 5e-3, 1e-2, 2e-2 with outer SGD 1.0 or Nesterov 0.7/0.9; DeMo's over 3e-3,
    # 1e-2, 3e-2 at 160 steps).
    lr: float = 1e-2  # dense AdamW (and Panthalia's) on the server
    sync_every: int = 8
    # Per chunk, every chunk (None: the library's default for sync_every, 472 of a full 64×64 tile and a
    # smaller chunk's share); 256 lands near 300× both ways on the digits MLP, where the held-out loss
    # matched dense's.
    sparseloco_topk: int | None = 256
    inner_lr: float = 1e-2
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    demo_lr: float = 1e-2
    demo_topk: int = 4
    topk: int = 32
    chunk: int = 32
    runs: tuple[str, ...] = DEFAULT_RUNS
    #: gradwire.aggregation.DEFAULT_RULE, written out: importing it would import torch (test_rogue_nodes checks).
    aggregation: str = "bounded_mean"
    seed: int = 0
    out_dir: str = "demo_out"

    def __post_init__(self) -> None:
        """Every value checked here, before a server or a worker starts (the command line turns a
        ``ValueError`` into a usage error)."""
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        from gradwire.aggregation import check_rule  # imports torch: only once the demo is going to run

        check_rule(self.aggregation)
        unknown = [r for r in self.runs if r not in RUNS]
        if unknown or not self.runs:
            raise ValueError(f"unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
        if self.steps % self.sync_every:
            raise ValueError(f"steps ({self.steps}) must be a multiple of sync_every ({self.sync_every})")
