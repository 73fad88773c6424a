"""DeMo and SparseLoCo as ``torch.optim.Optimizer`` s on torch.distributed (gloo, NCCL).

Both are thin transports around :mod:`gradwire.algorithms`: the node side forms this rank's records and
the ranks exchange them in one of two ways (``exchange=``):

- ``"sharded"`` (the default, :mod:`gradwire.torch.sharded`): the parameters are cut into pieces, each
  owned by one rank; every rank sends each owner its records of that owner's pieces (one all-to-all of
  bundle frames), each owner averages them exactly, re-encodes the mean with the downlink codec under
  its own error feedback, and the owners' frames are all-gathered and decoded by every rank. A rank's
  traffic stays under two frames' worth of records per step whatever the world size.
- ``"all_gather"``: one bundle frame per rank (``round`` = the step or sync counter, ``sender`` = the
  group rank) goes through :func:`~gradwire.torch.collectives.all_gather_bytes`, every rank reads every
  rank's frame (with :class:`~gradwire.Limits`) and averages them with
  :func:`~gradwire.algorithms.exact_mean` in rank order; a rank receives ``world − 1`` frames.

Either way every rank applies the update to the same decoded mean. ``exact_mean``, the decode and the
updates are fixed sequences of elementwise float32 operations on exactly decoded records, so all ranks
hold bit-identical weights afterwards (given that they started from the same weights, as DDP ensures
by broadcasting them).

Parameters are named by position, ``"g<group>.p<index>"`` (``"g0.p3"``: the fourth parameter of the
first group), so frames are the same whatever the modules are called; every rank must build its
optimizer over the same parameter list. Given ``model.named_parameters()`` (as torch's optimizers
accept it), errors name a parameter by its module path too: ``"h.0.attn.weight (g0.p3)"``.

Under ``DistributedDataParallel`` (the HF Trainer, Accelerate and Lightning wrap the model in it) the
first distributed step raises :class:`~gradwire.torch.ddp_guard.DenseAllReduceError` unless the DDP
module's comm hook is :func:`~gradwire.torch.ddp_guard.local_gradients_hook`: DDP's dense all-reduce
would otherwise run beside these frames and spend every byte they save (docs/RECIPES.md).

Counters (cumulative, frame bytes only — the length words and padding of the collectives are not
counted): ``bytes_sent`` is the length of this rank's own frames, ``bytes_received`` the total length of
the other ranks' frames this rank read. Sharded, ``bytes_sent`` counts this rank's phase-1 frames to the
other owners and its re-encoded frame (once, as the all-gather path counts its frame once), and
``bytes_received`` the frames the other ranks sent it in phase 1 and their re-encoded frames in phase 2.

Without an initialized process group (and no ``process_group``) both run as a group of one: the frame
is still written, read back and applied, so single-process code behaves as rank 0 of one. Under a launcher of
several ranks (``WORLD_SIZE`` > 1) with no process group their first step raises instead
(:class:`~gradwire.torch.NoProcessGroupError`, :mod:`gradwire.torch.launcher_check`).

Parameters may be FSDP2 ``DTensor`` s (``fully_shard``): each rank encodes, exchanges and updates its own
shard (:mod:`gradwire.torch.dtensor`), and ``process_group`` must join the replicas of that shard, e.g.
the replicate group of a ``(replicate, shard)`` mesh whose shard dimension FSDP runs over (checked when
the optimizer is built; docs/DISTRIBUTED.md, "Sharded models").
"""

from __future__ import annotations

from .demo_optimizer import DeMo
from .sparseloco_optimizer import SparseLoCo

__all__ = ["DeMo", "SparseLoCo"]
