# GPU diagnostics (not part of tessera; PYTHONPATH=benchmarks/site_diag:src): DUMP_AFTER=s dumps every thread's Python
# stack after s seconds; PIN=1 gives each local rank its own half of the physical cores (with their
# SMT siblings), so two ranks' host threads never share a core.
import faulthandler, glob, os, sys
if os.environ.get("DUMP_AFTER"):
    faulthandler.dump_traceback_later(float(os.environ["DUMP_AFTER"]), repeat=False, file=sys.stderr)
if os.environ.get("PIN") and "LOCAL_RANK" in os.environ:
    groups = sorted({tuple(sorted(int(c) for c in open(f).read().strip().replace("-", ",").split(",")))
                     for f in glob.glob("/sys/devices/system/cpu/cpu*/topology/thread_siblings_list")})
    r, n = int(os.environ["LOCAL_RANK"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = groups[r * len(groups) // n:(r + 1) * len(groups) // n]
    os.sched_setaffinity(0, {c for g in mine for c in g})
    print(f"PIN local rank {r}: cpus {sorted(c for g in mine for c in g)}", file=sys.stderr)
