"""mpedu's schedules against PyTorch's own generators: the same order rank by rank, makespan and peak at unit costs.

    python bench/schedules_vs_torch.py [--devices 2,4] [--micro-batches 4,8,10,12]
                                       [--schedules looped_bfs,zbv,dualpipev]

For each case, torch.distributed.pipelining's order (its _schedule_visualizer, 2 stages per rank) is read into
mpedu's actions through read_csv (torch's I = mpedu's B of a split backward, a full backward B = B with its W at
once, OVERLAP_F_B = its forward, then its backward) and compared, rank by rank, with mpedu's generator on the
same placement: round-robin for looped_bfs, the V (device r holds stages r and 2p-1-r) for zbv and dualpipev.
Both are played by mpedu's simulator at F = B = W = 1 per stage, transfers free: the makespan in ticks and each
device's peak of micro-batch-stages held. A case PyTorch refuses must be refused by mpedu too. No devices run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import finish, machine  # noqa: E402

from mpedu.core import schedules  # noqa: E402
from mpedu.predict import peak_in_flight, simulate  # noqa: E402

make, read_csv = schedules.make, schedules.read_csv

TORCH_NAMES = {"looped_bfs": "LoopedBFS", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def placement(name: str, p: int) -> list[int]:
    if name == "looped_bfs":
        return [s % p for s in range(2 * p)]
    return list(range(p)) + list(reversed(range(p)))


def unit_costs(schedule) -> tuple[float, list[float]]:
    timeline = simulate(schedule, [1.0] * schedule.num_stages, link="0s,inf")
    return timeline.makespan, list(peak_in_flight(timeline).values())


def torch_order(name: str, p: int, m: int):
    """PyTorch's order as an mpedu Schedule (via its CSV cells), or the words of its refusal."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    try:
        order = get_schedule_ops(TORCH_NAMES[name], p, m, num_stages_per_rank=2)
    except ValueError as e:
        return str(e)
    return read_csv("\n".join(",".join("" if a is None else str(a) for a in row) for row in order) + "\n")


def case(name: str, p: int, m: int) -> dict:
    row = {"schedule": name, "p": p, "m": m}
    theirs = torch_order(name, p, m)
    try:
        ours = make(name, placement(name, p), m)
    except ValueError as e:
        ours = str(e)
    if isinstance(theirs, str) or isinstance(ours, str):
        both = isinstance(theirs, str) and isinstance(ours, str)
        row.update(equal=both, torch_refuses=theirs if isinstance(theirs, str) else None,
                   mpedu_refuses=ours.split(";")[0] if isinstance(ours, str) else None)
        return row
    makespan, peaks = unit_costs(ours)
    torch_makespan, torch_peaks = unit_costs(theirs)
    differ = [r for r in range(p) if ours.actions[r] != theirs.actions[r]]
    row.update(equal=not differ and ours.overlapped == theirs.overlapped, ranks_differing=differ,
               makespan=makespan, torch_makespan=torch_makespan, peak=peaks, torch_peak=torch_peaks,
               overlapped=len(ours.overlapped), formula_6m_p_1=6 * m + p - 1)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="2,4", help="comma-separated device counts p (default: 2,4)")
    parser.add_argument("--micro-batches", default="4,8,10,12", help="comma-separated m (default: 4,8,10,12)")
    parser.add_argument("--schedules", default="looped_bfs,zbv,dualpipev",
                        help=f"comma-separated, of {', '.join(TORCH_NAMES)} (default: all)")
    args = parser.parse_args(argv)
    names = args.schedules.split(",")
    unknown = [n for n in names if n not in TORCH_NAMES]
    if unknown:
        parser.error(f"--schedules {unknown[0]}: compared with PyTorch are {', '.join(TORCH_NAMES)}")
    rows = [case(name, int(p), int(m)) for name in names for p in args.devices.split(",")
            for m in args.micro_batches.split(",")]
    print("F = B = W = 1 per stage (a full backward 2), transfers free; "
          "peak: micro-batch-stages held per device (mpedu's simulator)")
    print(f"{'schedule':<12}{'p':>3}{'m':>4}  {'same order':<11}{'makespan':>9}{'6m+p-1':>8}{'overlaps':>9}  peak")
    for r in rows:
        if "makespan" not in r:
            said = "both refuse" if r["equal"] else f"torch: {r['torch_refuses']}, mpedu: {r['mpedu_refuses']}"
            print(f"{r['schedule']:<12}{r['p']:>3}{r['m']:>4}  {'yes' if r['equal'] else 'NO':<11}  ({said})")
            continue
        same = "yes" if r["equal"] else f"NO {r['ranks_differing']}"
        print(f"{r['schedule']:<12}{r['p']:>3}{r['m']:>4}  {same:<11}{r['makespan']:>9g}{r['formula_6m_p_1']:>8}"
              f"{r['overlapped']:>9}  {','.join(f'{x:g}' for x in r['peak'])}")
    equal = sum(r["equal"] for r in rows)
    print(f"{equal} of {len(rows)} cases give PyTorch's order rank by rank (or are refused by both)")
    finish("schedules_vs_torch", {"benchmark": "schedules_vs_torch", "cases": len(rows), "equal": equal,
                                  "rows": rows, "machine": machine()})


if __name__ == "__main__":
    main()
