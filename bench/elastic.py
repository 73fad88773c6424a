"""Sites that fail and come back: gradwire.torch.FaultTolerant on a real torchft Lighthouse, 4 replica groups.

``python bench/elastic.py [--seeds 0 1] [--syncs 30] [--exchange sharded|all_gather] [--out docs/results/elastic.md]``

The membership trace, per seed: groups g0, g1, g2 start; g1 is SIGKILLed inside the exchange of its
``--die-at``-th round of three (step s1) and restarted at once (it rejoins at s2); g3 joins late, once the
run has committed ``--late`` rounds (s3). Every group stops at the ``--syncs``-th committed round. Beside it,
the uninterrupted run with the same membership trace: the same groups and seeds, g1 leaving cleanly after
round s1 (no kill: the round it would have died in commits) and a fresh g1 joining for round s2, g3 for round
s3, as the faulted run measured them (the rounds it got are printed beside it). Each group is a process
(bench/replica_group_worker.py: SparseLoCo, sync_every 8, its default codec, ``--exchange`` across the groups
— the sharded exchange by default, its pieces cut for 4 groups and their owners re-cut from each quorum, or the
all-gather —, over an MLP of two hidden layers
of 300 (95,701 parameters) on a nonlinear regression task; its data stream its own). And torchft's own DiLoCo
(``torchft.local_sgd.DiLoCo``, uncompressed fp32 all-reduce of the pseudo-gradients; bench/diloco_group_worker.py:
the same model, data, inner AdamW, outer SGD at learning rate 1.0, sync interval) on the faulted trace.
Printed, per seed, and the mean over the seeds:

- fault → commit: the time from g1's death to the survivors' first committed round after it, against the
  bound ``ReplicaTimeouts.fault_to_commit_bound`` (2 × (heartbeat timeout + quorum tick)), beside one sync
  interval of the uninterrupted run (the median time between commits: the local steps every commit waits for);
- rejoin → contributes: from the restarted group's rejoin (a warm standby process, imported and built, told
  to join; Python's start on this shared machine is not the protocol's) to its first committed round whose
  mean counted its frame, and at which of its syncs that was;
- the bytes the joiner (and the late group) downloaded, against its whole state (weights, anchor, error
  buffers, the inner optimizer's state: the raw tensor bytes) and against the weights alone;
- bit-identical: every group's weights and anchor hash equal at every step two groups logged;
- held-out loss at the end (the mean over the groups), against the uninterrupted run with the same trace;
- bytes per step between groups, against DDP's fp32 ring all-reduce (each rank sends, and receives,
  2 (n-1)/n × 4 bytes per parameter per step): each group's frames sent per local step, and the other groups'
  frames it received (the all-gather: n - 1 frames per sync; sharded: about (n - 1)/n of a frame per phase);
- torchft's DiLoCo: its held-out loss against gradwire's on the faulted trace, the ring against its bytes per
  step (its all-reduce counted as a ring moves it), and whether its groups stayed bit-identical.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gradwire.torch import ReplicaTimeouts
from replica_groups import FAST_TIMEOUTS, WORKER, ReplicaGroups  # bench/'s sibling script

ROOT = Path(__file__).resolve().parents[1]

NAMES = ("g0", "g1", "g2", "g3")
DILOCO = Path(__file__).with_name("diloco_group_worker.py")  # torchft's own DiLoCo, uncompressed


def one_run(folder: Path, seed: int, args, trace: dict | None, worker: Path = WORKER) -> dict:
    """The faulted run (``trace`` None), or the uninterrupted one with ``trace``'s membership (its s1, s2, s3):
    g1 leaves cleanly after round s1 and a fresh g1 joins for round s2, g3 for round s3, nobody killed."""
    run = ReplicaGroups(
        folder,
        groups=3,
        worker=worker,
        sync_every=8,
        exchange=args.exchange,
        cut_for=4,  # every group cuts the pieces for the trace's 4 groups (the owners follow each quorum)
        pause=args.pause,
        run_seed=seed,
        width=args.width,
        depth=args.depth,
    )
    try:
        if trace is None:
            run.start("g0")
            run.start("g1", die_at_sync=args.die_at)
            run.start("g2")
            # The restarted g1 and the late g3 are warm standbys (imported, built), so that the trace is held in
            # steps however slowly this shared machine starts Python: each joins when its file appears.
            run.start("g3", groups=4, wait_for=str(folder / "go-g3"))
            assert run.exit_code("g1", 300) == -9
            first_pid = run.procs["g1"].pid
            run.start("g1", wait_for=str(folder / "go-g1"))
            run.wait_for(
                lambda: [e for e in run.events("g1") if "standby" in e and e["pid"] != first_pid], 300, "g1's standby"
            )
            restart = time.time()
            (folder / "go-g1").write_text("")
            run.wait_for(lambda: max((r["step"] for r in run.rows("g0")), default=0) >= args.late, 300, "s3")
            (folder / "go-g3").write_text("")
        else:
            restart = None
            run.start("g0")
            run.start("g1", process="g1-first", leave_at=trace["s1"])
            run.start("g2")
            run.start("g1", wait_for=str(folder / "go-g1"))
            run.start("g3", groups=4, wait_for=str(folder / "go-g3"))
            first_pid = run.procs["g1-first"].pid
            for name, at in (("g1", trace["s2"]), ("g3", trace["s3"])):
                # told two rounds early: building its Manager takes about one round here
                run.wait_for(lambda at=at: max((r["step"] for r in run.rows("g0")), default=0) >= at - 2, 300, name)
                (folder / f"go-{name}").write_text("")
            assert run.exit_code("g1-first", 300) == 0, run.tails()
        run.stop_at(args.syncs)
        for n in NAMES:
            assert run.exit_code(n, 600) == 0, run.tails()
        ev = {n: run.events(n) for n in NAMES}
        rows = {n: run.rows(n) for n in NAMES}
    finally:
        run.close()
    out: dict = {}
    by_step: dict[int, set[str]] = {}
    for n in NAMES:
        for r in rows[n]:
            if r["groups"] > 1:
                by_step.setdefault(r["step"], set()).add(r["hash"])
    finals = [e for n in NAMES for e in ev[n] if e.get("final")]
    out["identical"] = all(len(h) == 1 for h in by_step.values()) and len({f["hash"] for f in finals}) == 1
    out["held_out"] = statistics.mean(f["held_out"] for f in finals)
    ready = next(e for e in ev["g0"] if "ready" in e)
    out["model_bytes"], out["state_bytes"] = ready["model_bytes"], ready["state_bytes"]
    sent = [r for n in NAMES for r in rows[n][-1:]]
    times = [r["time"] for r in rows["g0"]]
    out["interval"] = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
    out["bytes_per_step"] = statistics.mean(r["bytes_sent"] / r["local_steps"] for r in sent)
    out["received_per_step"] = statistics.mean(r["bytes_received"] / r["local_steps"] for r in sent)
    again = [e for e in ev["g1"] if e["pid"] != first_pid]
    back = [e for e in again if "hash" in e and "final" not in e]
    out["s2"] = back[0]["step"]
    out["s3"] = rows["g3"][0]["step"]
    if trace is not None:
        out["s1"] = next(e for e in ev["g1"] if "left" in e)["step"]
    else:
        died = next(e for e in ev["g1"] if "died" in e)
        after = [r for n in ("g0", "g2") for r in rows[n] if r["time"] > died["died"]]
        out["s1"] = died["step"]
        out["fault_to_commit"] = min(r["time"] for r in after) - died["died"]
        first = next(i for i, r in enumerate(back) if r["kept"] == r["groups"] and r["groups"] > 1)
        out["restart_to_contrib"] = back[first]["time"] - restart
        out["contrib_sync"] = first + 1
        out["downloaded"], out["raw_state"] = back[0]["downloaded"], back[0]["raw_state"]
        late = rows["g3"]
        out["late_downloaded"], out["late_raw"] = late[0]["downloaded"], late[0]["raw_state"]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--syncs", type=int, default=30)
    p.add_argument("--pause", type=float, default=0.05, help="seconds each group sleeps per step (its compute)")
    p.add_argument("--die-at", type=int, default=4)
    p.add_argument("--late", type=int, default=14)
    p.add_argument("--width", type=int, default=300)
    p.add_argument("--depth", type=int, default=2, help="hidden layers (2 × 300 wide: 95,701 parameters)")
    p.add_argument(
        "--exchange",
        choices=("sharded", "all_gather"),
        default="sharded",
        help="gradwire's exchange across the groups (sharded: owners re-cut from each quorum)",
    )
    p.add_argument("--no-diloco", dest="diloco", action="store_false", help="skip torchft's DiLoCo row")
    p.add_argument("--out", default=str(ROOT / "docs/results/elastic.md"))
    args = p.parse_args(argv)
    t = ReplicaTimeouts(**FAST_TIMEOUTS)
    bound = t.fault_to_commit_bound
    rows = []
    began = time.time()
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, tempfile.TemporaryDirectory() as c:
            f = one_run(Path(a), seed, args, trace=None)
            u = one_run(Path(b), seed, args, trace=f)
            t = one_run(Path(c), seed, args, trace=None, worker=DILOCO) if args.diloco else None
        rows.append((seed, f, u, t))
    params = rows[0][1]["model_bytes"] // 4
    ring = 2 * (4 - 1) / 4 * 4 * params
    lines = [
        "| seed | s1 / s2 / s3 | fault → commit (bound; one sync interval) | rejoin → contributes | at its sync "
        "| joiner downloads / state (/ weights) | late group downloads / state | bit-identical "
        "| held-out loss: trace / uninterrupted, same membership (its s1 / s2 / s3) (Δ) "
        "| DDP fp32 ring / bytes per step: sent, received "
        "| torchft DiLoCo, same trace: held-out (Δ vs gradwire's trace) · ring / its bytes per step · bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, f, u, t in rows:
        d = f["held_out"] / u["held_out"] - 1
        lines.append(
            f"| {seed} | {f['s1']} / {f['s2']} / {f['s3']} | {f['fault_to_commit']:.2f} s ({bound:.2f} s; "
            f"{u['interval']:.2f} s) "
            f"| {f['restart_to_contrib']:.2f} s | {f['contrib_sync']} "
            f"| {f['downloaded'] / f['raw_state']:.4f}× (+{f['downloaded'] - f['raw_state']:,} B; "
            f"{f['downloaded'] / f['model_bytes']:.2f}×) "
            f"| {f['late_downloaded'] / f['late_raw']:.4f}× | {'yes' if f['identical'] else 'NO'} "
            f"| {f['held_out']:.4f} / {u['held_out']:.4f} ({u['s1']} / {u['s2']} / {u['s3']}) ({d:+.2%}) "
            f"| {ring / f['bytes_per_step']:.0f}× fewer sent, "
            f"{ring / f['received_per_step']:.0f}× fewer received "
            + (
                f"| {t['held_out']:.4f} ({t['held_out'] / f['held_out'] - 1:+.2%}) · "
                f"{ring / t['bytes_per_step']:.1f}× · {'yes' if t['identical'] else 'NO'} |"
                if t is not None
                else "| not run |"
            )
        )
    deltas = [f["held_out"] / u["held_out"] - 1 for _, f, u, _ in rows]
    seeds = " ".join(map(str, args.seeds))
    summary = f"Mean over seeds {seeds}: held-out Δ trace vs uninterrupted {statistics.mean(deltas):+.2%}"
    if args.diloco:
        vs = [t["held_out"] / f["held_out"] - 1 for _, f, _, t in rows]
        summary += f"; torchft DiLoCo vs gradwire on the trace {statistics.mean(vs):+.2%}"
    table = "\n".join(lines) + "\n\n" + summary + "."
    print(table)
    took = time.time() - began
    today = dt.date.today().isoformat()
    cmd = "python bench/elastic.py " + " ".join(argv if argv is not None else sys.argv[1:])
    page = f"""# Elastic replica groups: faults, rejoins and late joiners on torchft

Written by `bench/elastic.py` on {today} (`{cmd.strip()}`, {took:.0f} s on a shared 2-core CPU).

4 replica groups as processes on one machine (gloo on loopback), a real torchft Lighthouse, SparseLoCo
(`sync_every=8`, its default codec, `exchange="{args.exchange}"`) over an MLP of {params:,} parameters; timeouts
`{FAST_TIMEOUTS}`. The trace: g0–g2 start, g1 is SIGKILLed inside its exchange at step s1 and restarted (a
fresh process, started beforehand as a warm standby and told to join at once; its first commit: s2), g3 joins
late at s3; all stop at committed round {args.syncs}.
The uninterrupted run: the same membership trace without a fault (g1 leaves cleanly after round s1, a fresh
g1 joins for round s2 and g3 for s3; the rounds it got in parentheses), the same seeds. Held-out loss: the
mean of the groups' final MSE on 512 held-out samples. The ring: DDP's fp32 all-reduce among 4, per local
step. torchft's DiLoCo: `torchft.local_sgd.DiLoCo` (fp32 all-reduce of the pseudo-gradients, the same model,
data, inner AdamW, outer SGD at 1.0 and interval) on the faulted trace; its bytes counted as a ring moves them.
The joiner's state crosses as gradwire's state bytes (one safetensors file): the "+ B" is that file's
header, a fixed cost per tensor, not history.

{table}
"""
    Path(args.out).write_text(page)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
