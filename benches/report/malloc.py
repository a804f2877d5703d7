"""glibc's allocator settings for every process that times Keel against torch
(the report's measuring runs, `report.py`, and the demo, `examples/demo.py`).

The report's measuring processes and the demo run with glibc's
`MALLOC_MMAP_THRESHOLD_` fixed at 1 MiB (unless it is set already), so that
every output of 1 MiB or more is fresh memory, as the report's floor (a
clone into fresh memory) assumes, for every contender alike. glibc's default
threshold moves with what was freed: in session 49's runs a contender's output
was at times memory freed before (no page faults, copy speed) and at times
fresh, whichever the heap held then (torch.compile's rotary (x.T) bf16 output
0 faults a call, Keel's beside it 8193: "0.28x torch.compile"). Small outputs
(decode shapes) come from the heap either way.

Fixing the mmap threshold also stops glibc moving its trim threshold, which
then stays at 128 KiB: a free that leaves that much at the top of the heap
hands it back to the system, and the next allocation faults it in again. In
the decode rows (`[32, 4096]` f32, 512 KiB a tensor) torch eager's
temporaries paid 48-224 page faults a call that way and read up to 5x slower
than in a process left to glibc's defaults (session 51; `silu(x) * x` alone:
372 µs against 42). So `MALLOC_TRIM_THRESHOLD_` is fixed too, at 64 MiB:
where glibc's own rule (twice the largest mapping freed, up to twice its 32
MiB mmap limit) puts it in any process that has freed a large tensor.

glibc reads both when a process starts, so they are passed in its
environment: `report.py` starts its measuring processes with them, and the
demo starts itself again with them where they are missing.
"""
import os

# glibc's mmap threshold (see above): outputs of 1 MiB or more are fresh mappings.
MMAP_THRESHOLD = 1 << 20
# glibc's trim threshold (see above): freed heap memory stays mapped.
TRIM_THRESHOLD = 64 << 20


def settings() -> dict:
    """The two variables, each as the environment has it where set, else the thresholds above."""
    return {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD)),
            "MALLOC_TRIM_THRESHOLD_": os.environ.get("MALLOC_TRIM_THRESHOLD_", str(TRIM_THRESHOLD))}
