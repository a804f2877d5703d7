"""Turns the JSON of one or more measuring runs into the report: a markdown
table per run, the per-call overhead, the list of missed targets, and two PNG
plots (speedup per op; achieved GB/s against the bandwidth lines).
"""
import os
import statistics
from typing import Callable, List, Optional, Tuple

from timing import UNSTEADY, agreeing

BW_TARGET = {"cpu": 0.80, "cuda": 0.85}  # fraction of the bandwidth line a bandwidth-bound op must reach
BW_LINE = {"cpu": "clone_GBps", "cuda": "copy_GBps"}  # CPU: fresh outputs pay page faults as clone does
KERNEL_NOTE = ("The `kernel` columns are the GPU's time per call in each contender's kernels (torch.profiler, the "
               "sum of its device events over 10 calls), and `kernel of bandwidth` Keel's GB/s over that time. A "
               "call also costs the CPU time of Python, the dispatcher and the launch; where that outlasts the "
               "kernel, the GPU waits, and the wall time (`Keel ms`) is the CPU's. The verdicts below are on the "
               "wall time; a bandwidth miss also gives the kernels' fraction.")


def _runs_by_device(runs: List[dict]):
    """(title, run, device) for each device of each run."""
    for run in runs:
        for device in run["bandwidth"]:
            yield f"{device.upper()}{', ' + run['label'] if run['label'] else ''}", run, device


def _ms(v: float) -> str:
    """Milliseconds to 3 significant figures."""
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def _gbps(row: dict, who: str) -> float:
    """GB/s of contender `who` (`keel`, `eager`, `compile`) on this row; 0 where it has no time."""
    return row["nbytes"] / row["ms"][who] / 1e6 if who in row["ms"] else 0.0


# Minor page faults a call from which its outputs count as fresh memory: a
# large output faults in every page (512 a 2 MiB of 4 KiB pages, one a huge
# page), memory reused from an earlier free none.
FRESH_FAULTS = 8


def _regime_switch(row: dict, device: str) -> Optional[str]:
    """Where the clone of a CPU row and Keel's call did not both get fresh
    memory, or both reused memory (page faults a call, recorded since session
    49): `"clone"` where Keel's outputs were fresh and the clone's memory was
    not, `"copy"` the other way round; None where they match, on CUDA, or
    where nothing was recorded."""
    f = row.get("faults")
    if device != "cpu" or not f or "keel" not in f or "clone" not in f or row.get("inplace"):
        return None
    keel, clone = f["keel"] >= FRESH_FAULTS, f["clone"] >= FRESH_FAULTS
    return None if keel == clone else "clone" if keel else "copy"


def _line(bw: dict, key: str) -> str:
    """A bandwidth line's GB/s for the table, with its two measures (at the
    start of the run and after its rows) where the run recorded them."""
    m = bw.get("measures")
    both = f" ({m['start'][key]:.1f} at the start, {m['end'][key]:.1f} after the rows)" if m else ""
    return f"{bw[key]:.1f}{both}"


def _line_gbps(row: dict, bw: dict, device: str) -> float:
    """The bandwidth an op's GB/s is held against. CPU: the floor timed beside
    the op in this row ([`_own_floor`]: same minutes, same sizes: this
    machine's bandwidth drifts up to 2x within a run, and a line measured at
    its ends does not say what the op had), unless the op's call and the
    clone did not pay the same page faults ([`_regime_switch`]): then the run's
    line of Keel's kind, the fresh clone or the copy into an existing tensor.
    CUDA, or rows from before their floor was recorded: the run's bandwidth
    line (an in-place row's: the copy's)."""
    own = _own_floor(row, device)
    if own is not None:
        return row[f"{own}_nbytes"] / row["ms"][own] / 1e6
    if row.get("inplace"):
        # No fresh output, no page faults: held against a copy into an existing tensor.
        return bw["copy_GBps"]
    switch = _regime_switch(row, device)
    if switch is not None:
        return bw[f"{switch}_GBps"]
    return bw[BW_LINE[device]]


def _own_floor(row: dict, device: str) -> Optional[str]:
    """The contender timed beside a CPU row's op that its bandwidth is held
    against (see `_line_gbps`): for an in-place row, which allocates nothing,
    the copy of its inputs into tensors already there (`copy`, recorded since
    session 71: until then the run's copy line, measured once at the start,
    which read 35 GB/s in one run and 56 in the next); for the others the
    fresh `clone`, where it paid the same page faults as the op. None where
    there is no such time, or on CUDA."""
    if device != "cpu":
        return None
    own = "copy" if row.get("inplace") else "clone"
    if own == "clone" and _regime_switch(row, device) is not None:
        return None
    return own if row.get(f"{own}_nbytes") and row["ms"].get(own) else None


def ratio(row: dict, a: str, b: str) -> float:
    """Contender `a`'s time over `b`'s on this row. Where the row was timed
    in passes (`ms_passes`), the median of each pass's ratio: the two were
    timed in the same rounds of a pass, under the same load, so a burst that
    slowed a whole pass leaves its ratio alone, where the ratio of the two
    medians could mix a slowed pass of one with a quiet pass of the other."""
    p = row.get("ms_passes", {})
    pa, pb = p.get(a, []), p.get(b, [])
    if len(pa) > 1 and len(pa) == len(pb):
        return statistics.median(x / y for x, y in zip(pa, pb))
    return row["ms"][a] / row["ms"][b]


def _speedups(row: dict) -> dict:
    """Keel's speedup over torch eager and over torch.compile (None where it has no time)."""
    compiled = "compile" in row["ms"]
    return {"vs_eager": ratio(row, "eager", "keel"), "vs_compile": ratio(row, "compile", "keel") if compiled else None}


def _derived(row: dict, bw: dict, device: str) -> dict:
    d = {**_speedups(row), "gbps": _gbps(row, "keel"), "floor": ratio(row, "keel", "clone")}
    own = _own_floor(row, device)
    if own is not None:
        # Keel's GB/s over its floor's, pass by pass (`ratio`).
        d["frac"] = row["nbytes"] / row[f"{own}_nbytes"] * ratio(row, own, "keel")
    else:
        d["frac"] = d["gbps"] / _line_gbps(row, bw, device)
    return d


def _kernel_frac(row: dict, bw: dict, device: str) -> Optional[float]:
    """Keel's GB/s over its GPU kernel time (`kernel_us`), as a fraction of
    the row's bandwidth line; None where the run recorded no kernel time."""
    us = row.get("kernel_us", {}).get("keel")
    return row["nbytes"] / us / 1e3 / _line_gbps(row, bw, device) if us else None


def _kernel_us_cells(row: dict, who) -> List[str]:
    """The kernel µs per call of each contender in `who` ("-" where not recorded)."""
    ku = row.get("kernel_us", {})
    return [f"{ku[k]:.1f}" if ku.get(k) else "-" for k in who]


def _kernel_cells(row: dict, bw: dict, device: str) -> List[str]:
    """The kernel-time cells of a CUDA row: Keel's, eager's and compile's
    kernel µs per call, and Keel's kernel fraction of the bandwidth ("-" for
    what was not recorded)."""
    cells = _kernel_us_cells(row, ("keel", "eager", "compile"))
    kf = _kernel_frac(row, bw, device)
    frac = "-" if kf is None else f"{100 * kf:.0f}%" if row["bandwidth_bound"] else f"({100 * kf:.0f}%)"
    return cells + [frac]


def _speed_misses(row: dict, d: dict) -> List[str]:
    """A row's error over tolerance, and its being slower than eager or compile."""
    m = []
    if not row["ok"]:
        m.append(f"error {row['err']['keel']:.1e} over tolerance")
    if d["vs_eager"] < 1.0:
        m.append(f"{d['vs_eager']:.2f}x torch eager")
    if d["vs_compile"] is not None and d["vs_compile"] < 1.0:
        m.append(f"{d['vs_compile']:.2f}x torch.compile")
    return m


def _misses(row: dict, d: dict, device: str, bw: dict) -> List[str]:
    m = _speed_misses(row, d)
    if row["bandwidth_bound"] and d["frac"] < BW_TARGET[device]:
        kf = _kernel_frac(row, bw, device)
        kernel = f"; its kernels {100 * kf:.0f}%" if kf is not None else ""
        m.append(f"{100 * d['frac']:.0f}% of bandwidth (target {100 * BW_TARGET[device]:.0f}%{kernel})")
    return m


def _trim(trim: str) -> str:
    """The header's words on glibc's fixed trim threshold (report.py)."""
    return (f"; `MALLOC_TRIM_THRESHOLD_={trim}`: freed heap memory up to {int(trim) / 2**20:g} MiB stays mapped, as "
            "glibc's own rule leaves it in a process that has freed a large tensor (with the mmap threshold fixed "
            "and this one not, it stayed at 128 KiB, and torch's temporaries at decode shapes paid page faults at "
            "every call).")


def markdown(runs: List[dict], images: List[str]) -> str:
    m0 = runs[0]["machine"]
    lines = ["# Keel benchmark report", ""]
    lines.append(f"Measured {m0['date']} on **{m0['cpu']}**, {m0['cores']} cores ({m0['torch_threads']} torch threads), "
                 f"torch {m0['torch']}, Keel {m0['keel']}, Python {m0['python']}; transparent huge pages "
                 f"`{m0['thp_sysfs']}`." + (f" Keel's CPU kernels run {m0['simd']}." if "simd" in m0 else ""))
    if "gpu" in m0:
        lines.append(f"GPU: **{m0['gpu']}** ({m0['gpu_memory_gib']} GiB), driver {m0['driver']}, CUDA {m0['cuda']}.")
    else:
        lines.append("No GPU on this machine: the CUDA section is absent.")
    mmap = m0.get("MALLOC_MMAP_THRESHOLD_")
    if mmap:
        trim = m0.get("MALLOC_TRIM_THRESHOLD_")
        lines.append(f"glibc's `MALLOC_MMAP_THRESHOLD_={mmap}`: outputs of {int(mmap) / 2**20:g} MiB or more are fresh "
                     "memory for every contender (the default threshold moves with what was freed, and gave one "
                     "contender memory freed before, no page faults, beside another's fresh output)"
                     + (_trim(trim) if trim else "."))
    cut = [run.get("label") or "default" for run in runs if run.get("complete") is False]
    if cut:
        lines.append(f"**Run cut short** ({', '.join(cut)}): the tables hold the cases measured before it stopped.")
    lines += ["", "Produced by `scripts/report.sh` (the command regenerates this file and the plots). Each op is timed "
              "as Keel (`torch.ops.keel`), the torch eager expression it replaces, `torch.compile` of that same "
              "expression, and a `clone` of its inputs, interleaved in one run on the same inputs (each round in a "
              "rotated order, so that each follows each of the others in turn); figures are "
              f"{_medians(runs)}. GB/s counts the bytes an op must read and write once (the least any kernel moves). The "
              "bandwidth an op is held against (`of bandwidth`) is, on CPU, that of the fresh `clone` timed beside "
              "it in the same row (outputs are fresh allocations there, and pay the same page faults; the clone "
              "line of the table below is the faster of two measures, at the start of the run and after its rows, "
              "and this machine's bandwidth drifts during a run; where a row's clone and Keel's call did not pay the "
              "same page faults, one writing fresh pages and "
              "the other reusing memory freed before, the row is held against the run's line of Keel's kind instead, "
              "and marked: see below the tables), and on CUDA "
              "a copy into an existing tensor. `err` is the largest error against float64, "
              "relative to the output's scale. Two rows take strided views, which Keel reads in place and torch "
              "gets the same: `rotary_embedding (x.T)` (a `[batch, heads, seq, head_dim]` q passed transposed, as "
              "Llama lays it out) and `rms_norm (qkv view)` (QK-norm on q of a fused qkv projection, viewed "
              "`[tokens, heads, head_dim]`). The `(in place)` rows are vLLM's in-place forms, "
              "against the same in torch (`r.add_(x); x.copy_(F.rms_norm(r, ...))`, `q.copy_(rope(q))`); they allocate "
              "nothing, so their bandwidth is held against a copy of the same inputs into tensors already there, timed "
              "beside them in the same row (on CUDA, the run's copy line).", ""]
    lines += ["## Memory bandwidth", "", "| run | device | clone (fresh output) GB/s | copy into existing GB/s |",
              "|---|---|---|---|"]
    for title, run, device in _runs_by_device(runs):
        bw = run["bandwidth"][device]
        lines.append(f"| {title} | {device} | {_line(bw, 'clone_GBps')} | {_line(bw, 'copy_GBps')} |")
    lines.append("")
    misses = []
    for title, run, device in _runs_by_device(runs):
        bw = run["bandwidth"][device]
        kernels = any("kernel_us" in r for r in run["rows"] if r["device"] == device)
        head = ("| op | dtype | shape | Keel ms | eager ms | compile ms | vs eager | vs compile | Keel GB/s "
                "| of bandwidth | Keel / clone | err |")
        if kernels:
            head += " Keel kernel µs | eager kernel µs | compile kernel µs | kernel of bandwidth |"
            lines += [f"## {title}", "", KERNEL_NOTE, ""]
        else:
            lines += [f"## {title}", ""]
        columns = 16 if kernels else 12
        lines += [head, "|" + "---|" * columns]
        for row in run["rows"]:
            if row["device"] != device:
                continue
            if "error" in row:
                lines.append(_failed_row([], row, columns))
                misses.append(f"- {title}: {row['op']} {row['dtype']} raised: {row['error']}")
                continue
            d = _derived(row, bw, device)
            ms = row["ms"]
            comp, vc = _compile_cells(row, d, _ms)
            frac = f"{100 * d['frac']:.0f}%" if row["bandwidth_bound"] else f"({100 * d['frac']:.0f}%)"
            frac += {None: "", "clone": " ᶜ", "copy": " ʳ"}[_regime_switch(row, device)]
            line = (f"| {row['op']} | {row['dtype']} | {row['shape']} | {_ms(ms['keel'])} | {_ms(ms['eager'])} | "
                    f"{comp} | {d['vs_eager']:.2f}x | {vc} | {d['gbps']:.1f} | {frac} | {d['floor']:.2f} | "
                    f"{row['err']['keel']:.1e} |")
            if kernels:
                line += " " + " | ".join(_kernel_cells(row, bw, device)) + " |"
            lines.append(line)
            for why in _misses(row, d, device, bw):
                misses.append(f"- {title}: {row['op']} {row['dtype']}: {why}")
            if "compile_error" in row:
                misses.append(f"- {title}: torch.compile of {row['op']} {row['dtype']} failed: {row['compile_error']}")
            if "kernel_error" in row:
                misses.append(f"- {title}: the kernel times of {row['op']} {row['dtype']} were not recorded: "
                              f"{row['kernel_error']}")
        lines.append("")
    lines += ["Bracketed fractions are for ops bound by compute, not memory (cross_entropy runs two `exp` per logit); "
              "they have no bandwidth target.", ""]
    if any(_regime_switch(r, r.get("device")) for run in runs for r in run["rows"] if "error" not in r):
        lines += ["Page faults decide the CPU rows marked ᶜ and ʳ (each call's minor page faults are recorded, "
                  "`faults` in raw.json). The clone beside an op is its reference only where both paid the same "
                  "faults: both wrote fresh pages, or both reused memory freed before. ᶜ: Keel's outputs were "
                  "fresh and the clone reused memory (it ran at copy speed), so the row is held against the run's "
                  "fresh-clone line; ʳ: Keel reused memory and the clone did not, so the row is held against the "
                  "run's copy into an existing tensor. `Keel / clone` is still the row's own ratio.", ""]
    lines += _unsteady(runs)
    lines += _decode(runs, misses)
    lines += ["## Per-call overhead (tiny float32 tensors)", "",
              "The target is judged on the `torch.ops.keel` column (issue 5); the typed API (`keel.softmax` ...), "
              "what users call, skips torch's Python autograd kernel where no gradient can be needed.", "",
              "| run | mode | op | Keel µs (`torch.ops.keel`) | Keel µs (`keel.*`) | torch µs (the expression it replaces) |",
              "|---|---|---|---|---|---|"]
    for title, run, device in _runs_by_device(runs):
        for o in run["overhead"]:
            if o["device"] == device:
                mode = o.get("mode", "grad mode")
                k = f"{o['keel_us']:.2f}" if o["keel_us"] is not None else "-"
                typed = f"{o['typed_us']:.2f}" if o.get("typed_us") is not None else "-"
                lines.append(f"| {title} | {mode} | {o['name']} | {k} | {typed} | {o['torch_us']:.2f} |")
                if o["keel_us"] is not None and o["keel_us"] > o["torch_us"]:
                    misses.append(f"- {title}: per-call overhead of {o['name']} ({mode}): {o['keel_us']:.2f} µs "
                                  f"against torch's {o['torch_us']:.2f} µs")
    lines += ["", "## Plots", ""] + [f"![{os.path.splitext(i)[0]}]({i})" for i in images]
    lines += ["", "## Targets missed in this run", ""] + (misses or ["None."]) + [""]
    return "\n".join(lines)


def _medians(runs: list) -> str:
    """How a row's figures were taken, as the header says it."""
    passes = max((run.get("passes", 1) for run in runs), default=1)
    if passes == 1:
        return "medians"
    extra = max((run.get("extra_passes", 0) for run in runs), default=0)
    again = (f"; a row whose passes disagree on Keel's time (no majority of them within "
             f"{round(100 * (UNSTEADY - 1))}% of each other) is timed in further passes, up to {extra} more, until "
             "they agree (`extra_passes` in raw.json counts them)") if extra else ""
    return (f"the median of {passes} passes' medians: each run goes {passes} times through all its cases, timing "
            "each for a part of its budget, so that a burst of load on the machine spoils one pass of a row, not "
            f"the row (`ms_passes` in raw.json keeps each pass's medians){again}. A ratio (`vs eager`, `vs compile`, "
            "`of bandwidth` against the row's clone, `Keel / clone`) is the median of the ratios within each pass, "
            "whose contenders shared its load, so it need not be the ratio of the two times shown")


def _unsteady(runs: list) -> list:
    """Lines naming the rows timed in extra passes (`measure.time_cases`), and
    those whose passes still did not agree on Keel's time (`timing.agreeing`):
    their medians stand, but the machine's load moved under them. Nothing for
    runs timed in one pass."""
    again, names = [], []
    for title, run, device in _runs_by_device(runs):
        for part in ("rows", "decode"):
            for r in run.get(part, []):
                p = r.get("ms_passes", {}).get("keel", [])
                if r.get("device") != device or len(p) < 2:
                    continue
                name = f"{title}{', decode' if part == 'decode' else ''}: {r['op']} {r['dtype']}"
                if r.get("extra_passes"):
                    again.append(f"{name} ({r['extra_passes']})")
                if not agreeing(p):
                    names.append(f"{name} ({min(p):.3g}-{max(p):.3g} ms)")
    lines = []
    if again:
        lines += [f"Rows timed in extra passes (how many), their first passes disagreeing: {'; '.join(again)}.", ""]
    if names:
        lines += [f"Rows whose passes did not agree on Keel's time (no majority of them within "
                  f"{round(100 * (UNSTEADY - 1))}% of each other; the machine's load moved during them, and the "
                  "median pass stands): " + "; ".join(names) + ".", ""]
    return lines


def _us(ms: float) -> str:
    return f"{1e3 * ms:.1f}"


def _failed_row(lead: List[str], row: dict, columns: int) -> str:
    """A table line for a row whose Keel call raised: the `lead` cells, the
    op, dtype and shape, the error, and blanks up to `columns` cells."""
    cells = lead + [row["op"], row["dtype"], row["shape"], f"failed: {row['error']}"]
    return "| " + " | ".join(cells + [""] * (columns - len(cells))) + " |"


def _compile_cells(row: dict, d: dict, fmt: Callable[[float], str]) -> Tuple[str, str]:
    """The `compile` time cell (formatted by `fmt`; "failed" where
    torch.compile raised, "-" where it was not timed) and the `vs compile` cell."""
    ms = row["ms"]
    comp = fmt(ms["compile"]) if "compile" in ms else "failed" if "compile_error" in row else "-"
    return comp, f"{d['vs_compile']:.2f}x" if d["vs_compile"] else "-"


def _decode(runs: List[dict], misses: List[str]) -> List[str]:
    """The decode-shapes table (forward ops on one decoding step's tensors, in
    microseconds); its slower-than-torch rows go to `misses`."""
    if not any(run.get("decode") for run in runs):
        return []
    lines = ["## Decode-sized calls (forward)", "",
             "One decoding step of 32 sequences: `[32, 4096]` activations (`[32, 8192]` into the gated ops), rotary on "
             "`[1, 32, 32, 128]` (the 32 tokens as the sequence, each with its own position's cos and sin), QK-norm "
             "on `[32, 32, 128]` viewed from a fused qkv. Here a call "
             "moves a few hundred KB, so the time is mostly the call itself, the allocation, and spreading the work "
             "over the threads. Timed as above (interleaved, medians), under `torch.no_grad()`, as a model decodes "
             "(Hugging Face's `generate()` does so). `Keel µs` is a call through `torch.ops.keel`, which first "
             "passes through Keel's Python autograd kernel: about 2-2.5 µs (see the per-call overhead below), "
             "4 µs for the in-place ops; the verdicts are on it. The typed API (`keel.rms_norm` ..., which "
             "`keel.nn` calls) skips that kernel where no gradient can be needed, as here: its column is what a "
             "model gets (`vs eager, keel.*`). Under `torch.inference_mode()` neither runs it.", "",
             "| run | op | dtype | shape | Keel µs | Keel µs (`keel.*`) | eager µs | compile µs | vs eager "
             "| vs eager, `keel.*` | vs compile | err |"]
    kernels = any("kernel_us" in r for run in runs for r in run.get("decode", []))
    if kernels:
        lines[-1] += " Keel kernel µs | eager kernel µs |"
        lines[2] += (" On CUDA, `kernel µs` is the GPU's time per call in Keel's and in torch eager's kernels "
                     "(torch.profiler), against which the rest of a call's time is the CPU's.")
    columns = 14 if kernels else 12
    lines.append("|" + "---|" * columns)
    for title, run, device in _runs_by_device(runs):
        for row in run.get("decode", []):
            if row["device"] != device:
                continue
            if "error" in row:
                lines.append(_failed_row([title], row, columns))
                misses.append(f"- {title}, decode: {row['op']} {row['dtype']} raised: {row['error']}")
                continue
            ms, d = row["ms"], _speedups(row)
            comp, vc = _compile_cells(row, d, _us)
            # Older runs (and cases without a typed call) have no `typed` time.
            typed, vt = (_us(ms["typed"]), f"{ratio(row, 'eager', 'typed'):.2f}x") if "typed" in ms else ("-", "-")
            err = max(row["err"]["keel"], row["err"].get("typed", 0.0))
            line = (f"| {title} | {row['op']} | {row['dtype']} | {row['shape']} | {_us(ms['keel'])} | {typed} | "
                    f"{_us(ms['eager'])} | {comp} | {d['vs_eager']:.2f}x | {vt} | {vc} | {err:.1e} |")
            if kernels:
                line += " " + " | ".join(_kernel_us_cells(row, ("keel", "eager"))) + " |"
            lines.append(line)
            misses += [f"- {title}, decode: {row['op']} {row['dtype']} {row['shape']}: {w}"
                       for w in _speed_misses(row, d)]
    return lines + [""]


def plot_floor(row: dict, bw: dict, device: str) -> Tuple[float, float]:
    """Where bandwidth.png marks a CPU row's floor and its target, in GB/s: the
    bandwidth the row is judged against ([`_line_gbps`]: the clone, or for an
    in-place row the copy, timed beside it) and `BW_TARGET` of it. Row by row,
    as the verdicts are: the run's lines moved by up to 1.8x between runs on
    one VM, and a target drawn from them disagreed with the table."""
    floor = _line_gbps(row, bw, device)
    return floor, floor * BW_TARGET[device]


def plots(runs: List[dict], outdir: str) -> List[str]:
    """Writes speedup.png and bandwidth.png; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(_runs_by_device(runs))
    names = []
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, (title, run, device) in zip(axes[:, 0], panels):
        rows = [r for r in run["rows"] if r["device"] == device and "error" not in r]
        ops = list(dict.fromkeys(r["op"] for r in rows))
        dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
        series = [(f"vs eager, {dt}", dt, "eager") for dt in dtypes] + [(f"vs compile, {dt}", dt, "compile")
                                                                          for dt in dtypes]
        width = 0.8 / len(series)
        for i, (label, dt, base) in enumerate(series):
            vals = []
            for op in ops:
                r = next((r for r in rows if r["op"] == op and r["dtype"] == dt), None)
                vals.append(ratio(r, base, "keel") if r and base in r["ms"] else 0)
            ax.bar([j + i * width for j in range(len(ops))], vals, width, label=label)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ops))], ops, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("speedup (torch time / Keel time)")
        ax.set_yscale("log")
        ax.set_title(f"Keel speedup, {title}")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "speedup.png"), dpi=90)
    plt.close(fig)
    names.append("speedup.png")

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, (title, run, device) in zip(axes[:, 0], panels):
        bw = run["bandwidth"][device]
        rows = [r for r in run["rows"] if r["device"] == device and "error" not in r]
        short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
        labels = [f"{r['op']} {short.get(r['dtype'], r['dtype'])}" for r in rows]
        xs = range(len(rows))
        for k, (who, label) in enumerate([("keel", "Keel"), ("eager", "torch eager"), ("compile", "torch.compile")]):
            ax.bar([x + 0.27 * (k - 1) for x in xs], [_gbps(r, who) for r in rows], 0.27, label=label)
        ax.axhline(bw["clone_GBps"], color="black", lw=1, label=f"clone {bw['clone_GBps']:.0f} GB/s")
        ax.axhline(bw["copy_GBps"], color="gray", ls="--", lw=1, label=f"copy into existing {bw['copy_GBps']:.0f} GB/s")
        target = f"target {100 * BW_TARGET[device]:.0f}%"
        if device == "cpu":
            floors, targets = zip(*(plot_floor(r, bw, device) for r in rows)) if rows else ((), ())
            ax.scatter(list(xs), floors, marker="_", s=160, color="black", zorder=3,
                       label="floor timed beside each op (clone; copy for in-place ops)")
            ax.scatter(list(xs), targets, marker="_", s=160, color="red", zorder=3, label=f"{target} of that floor")
        else:
            line = bw[BW_LINE[device]] * BW_TARGET[device]
            ax.axhline(line, color="red", ls=":", lw=1, label=f"{target} = {line:.0f} GB/s")
        ax.set_xticks(list(xs), labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("GB/s (read + written)")
        ax.set_title(f"Achieved bandwidth, {title}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "bandwidth.png"), dpi=90)
    plt.close(fig)
    names.append("bandwidth.png")
    return names
