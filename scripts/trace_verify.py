"""Per-CTA timeline of one sm90 verify variant under the benchmark (a perf-work tool).

The variant's rendered source is patched (never the templates) so that thread 0 of every CTA
records %globaltimer at: kernel entry, the return of griddepcontrol.wait, and per unit the
loop top, the state's arrival, the projections barrier and the unit's end, then the exit;
for the first unit also its norms barrier, the issue of its look-ahead loads and its
coupling barrier (the ``state-probe`` patch adds when the first state landed).
The records of the last launch of the benchmark's CUDA graph are summarised: when the CTAs
start, when the first states land, how long a unit takes in steady state, and the tail.

Usage (GPU host, the devkit sourced):
    python scripts/trace_verify.py VARIANT BATCH [BATCH ...] [--trace] [--check] [--config=NAME ...]
prints us per launch (the benchmark's method) for each ``--config`` (an experimental source
patch of ``CONFIGS``, or several chained as ``a+b``; default: the rendered kernel as it is),
with ``--trace`` the timeline of each, and with ``--check`` first runs ``kdagen check``'s
cases on each patched build. Only ``sm90_wgmma`` variants with one stage take the
``--config`` patches.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import sys
import tempfile

os.environ["KDAGEN_CACHE"] = tempfile.mkdtemp(prefix="kdagen-trace-")  # patched builds only

import torch  # noqa: E402

import kdagen.compile as kcompile  # noqa: E402
import kdagen.render as krender  # noqa: E402
from kdagen.bench import copy_bandwidth, floor_us, time_graph, verify_launch, verify_sets  # noqa: E402
from kdagen.serve.variant import Variant  # noqa: E402

SLOTS = 128  # int64 records per CTA: 12 header fields, then 4 per unit
HEADER = 12
UNITS = (SLOTS - HEADER) // 4
ORIGINAL_RENDER = krender.render

HELPERS = '''

@cute.jit
def trace_put(index: Int32, value: Int64):
    """Thread 0 stores one record of its CTA (trace_verify.py)."""
    tid, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    if tid == 0:
        address = Int64({base}) + (Int64(cta) * {slots} + Int64(index)) * 8
        cute.arch.inline_ptx("st.global.u64 [{{$r0}}], {{$r1}};", read_only_args=[address, value])


@cute.jit
def trace_unit(n: Int32, field: cutlass.Constexpr[int]):
    trace_put({header} + 4 * cutlass.min(n, {units} - 1) + field, cute.arch.globaltimer())

'''


def _insert(source: str, anchor: str, text: str, after: bool = True, nth: int = 0) -> str:
    """Insert ``text`` (its indentation given) on the line after (or before) the ``nth``
    line containing ``anchor``."""
    lines = source.split("\n")
    hits = [i for i, line in enumerate(lines) if anchor in line]
    if len(hits) <= nth:
        raise SystemExit(f"trace: anchor not found in the rendered source: {anchor!r}")
    at = hits[nth] + (1 if after else 0)
    return "\n".join(lines[:at] + text.split("\n") + lines[at:])


CALL_CLOSE = ")  # fmt: skip\n"  # the line that closes a multi-line call in a render


def _call_end(source: str, start: int) -> int:
    """Where the line after the multi-line call starting at ``start`` begins."""
    return source.index(CALL_CLOSE, start) + len(CALL_CLOSE)


def _first_load_start(source: str) -> int:
    """Where the line of the first unit's ``load_activations`` call (the one after its
    ticket, before the loop) begins."""
    call = source.index("self.load_activations(", source.index("ticket = Int32(0)"))
    return source.rindex("\n", 0, call) + 1


def _first_load_end(source: str) -> int:
    """Where the line after the first unit's ``load_activations`` call (before the loop)
    begins."""
    return _call_end(source, _first_load_start(source))


def _lookahead_block(source: str) -> tuple[int, int]:
    """Start and end of the block that issues the next unit's input loads (one warpgroup
    per unit, after the norms barrier)."""
    head = source.index("            # The registers are free")
    return head, _call_end(source, head)


def patch(source: str, base: int) -> str:
    """The rendered module with the trace records added."""
    helpers = HELPERS.format(base=base, slots=SLOTS, header=HEADER, units=UNITS)
    source = _insert(source, "class Kda", helpers, after=False)
    source = _insert(
        source,
        "warp, lane = tid // 32, tid % 32",
        (
            "        trace_t0 = cute.arch.globaltimer()\n"
            "        trace_t1 = trace_t0\n"
            "        trace_n = Int32(0)"
        ),
    )
    source = _insert(
        source, "griddepcontrol_launch_dependents()", "        trace_t1 = cute.arch.globaltimer()"
    )
    # Before the loop: the first request's meta arrived (the window's addresses known) and
    # the window loads issued. (Field 10 held v11's ticket barrier; v12 has none.)
    meta_arrived = (
        "        if bos > -1:  # waits for the meta, as the window loads' addresses do\n"
        "            trace_put(8, cute.arch.globaltimer())\n"
    )
    start = _first_load_start(source)
    source = source[:start] + meta_arrived + source[start:]
    loaded = _first_load_end(source)
    source = source[:loaded] + "        trace_put(9, cute.arch.globaltimer())\n" + source[loaded:]
    source = _insert(source, "while unit < units:", "            trace_unit(trace_n, 0)")
    source = _insert(
        source, "cute.arch.mbarrier_wait(state_full", "                trace_unit(trace_n, 1)"
    )
    # The first unit's stages before its state wait, where the render has them (one
    # warpgroup per unit; the two-warpgroup block has other barriers).
    first_record = (
        "            if trace_n == 0:\n                trace_put({}, cute.arch.globaltimer())"
    )
    for anchor, field in (("# norms and betas", 5), ("# probes and coupling partials", 6)):
        if f"cute.arch.barrier()  {anchor}" in source:
            source = _insert(source, f"cute.arch.barrier()  {anchor}", first_record.format(field))
    if "# The registers are free" in source:  # the look-ahead loads issued (addresses known)
        issued = _lookahead_block(source)[1]
        source = source[:issued] + first_record.format(7) + "\n" + source[issued:]
    source = _insert(
        source, "cute.arch.barrier()  # projections", "            trace_unit(trace_n, 2)"
    )
    source = _insert(
        source,
        "unit, nxt = nxt, after",
        ("            trace_unit(trace_n, 3)\n            trace_n = trace_n + 1"),
        after=False,
    )
    source = _insert(
        source,
        "parity = parity ^ 1",
        (
            "        trace_put(2, cute.arch.globaltimer())\n"
            "        trace_put(0, trace_t0)\n"
            "        trace_put(1, trace_t1)\n"
            "        trace_put(3, Int64(trace_n))"
        ),
    )
    return source


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return (
        f"{values[0]:6.2f} / {statistics.median(values):6.2f} / "
        f"{values[int(0.9 * (len(values) - 1))]:6.2f} / {values[-1]:6.2f}"
    )


def summarise(records: torch.Tensor, ctas: int, period_us: float, floor: float) -> None:
    rows = records.view(-1, SLOTS)[:ctas].tolist()
    base = min(r[0] for r in rows)
    us = lambda t: (t - base) * 1e-3  # noqa: E731
    counts = [min(r[3], UNITS) for r in rows]
    units = [
        [r[HEADER + 4 * i : HEADER + 4 * i + 4] for i in range(n)]
        for r, n in zip(rows, counts, strict=True)
    ]
    ready = [us(u[1]) for cta in units for u in cta if u[1]]  # none where no state was waited on
    steady = [(cta[i][3] - cta[i - 1][3]) * 1e-3 for cta in units for i in range(1, len(cta))]
    waits = [(u[1] - u[0]) * 1e-3 for cta in units for u in cta if u[1]]
    solve = [(u[3] - u[2]) * 1e-3 for cta in units for u in cta]
    exits = [us(r[2]) for r in rows]
    print(
        f"  period (graph time per launch) {period_us:.2f} us, floor {floor:.2f} us, "
        f"span (first entry -> last exit) {max(exits):.2f} us"
    )
    print("  (min / median / p90 / max, us from the first CTA's entry)")
    print(f"  entry                 {_stats([us(r[0]) for r in rows])}")
    print(f"  griddepcontrol.wait   {_stats([us(r[1]) for r in rows])}")
    for label, field in (("meta arrived", 8), ("window issued", 9)):
        if any(r[field] for r in rows):
            print(f"  {label:<21} {_stats([us(r[field]) for r in rows if r[field]])}")
    print(f"  first loop top        {_stats([us(c[0][0]) for c in units if c])}")
    working = [r for r, c in zip(rows, units, strict=True) if c]  # CTAs with a first unit
    for label, field in (("norms barrier  ", 5), ("next loads out ", 7), ("coupling barr. ", 6)):
        if any(r[field] for r in working):  # recorded where the render has the stage
            print(f"  first {label} {_stats([us(r[field]) for r in working])}")
    print(f"  first state ready     {_stats([us(c[0][1]) for c in units if c and c[0][1]])}")
    print(f"  first unit end        {_stats([us(c[0][3]) for c in units if c])}")
    print(f"  last state ready      {_stats([us(c[-1][1]) for c in units if c and c[-1][1]])}")
    landed = [us(r[4]) for r in rows if r[4]]
    if landed:
        print(f"  first state landed    {_stats(landed)}  (state-probe: waited on at once)")
    print(f"  exit                  {_stats(exits)}")
    print(f"  units per CTA         {min(counts)} / {statistics.median(counts)} / {max(counts)}")
    print(f"  unit period (end to end, us)        {_stats(steady)}")
    print(f"  loop top -> state ready (us)        {_stats(waits)}")
    print(f"  projections -> unit end (us)        {_stats(solve)}")
    bins = [0] * (int(max(ready, default=0)) + 1)
    for t in ready:
        bins[int(t)] += 1
    print("  states ready per us: " + " ".join(str(b) for b in bins))


PROLOGUE_LOAD = """        if warp == 0:  # noqa: SIM102 (traced: `and` does not combine traced values)
            if first_slot > Int64(null_slot):
"""


ONE_WAVE_RULE = "        if units <= ctas:\n            early = cta < SMS\n"
EARLY_RULE = (
    """\
        # The CTAs that request their first state here, under the previous kernel: from two
        # waves on all but the grid bound's last SMS, in a one-wave launch only the first SMS.
        # The others request theirs after their first window, which then no longer queues
        # behind those states in HBM; theirs still arrive before the coupling needs them (v19).
        early = cta < CTAS - SMS
"""
    + ONE_WAVE_RULE
)
LATE_REQUEST = "            if ~early & (first_slot > Int64(null_slot)):\n"
V19_REQUESTS = "an sm90_wgmma variant with v19's first-state requests"


def early_states(source: str) -> str:
    """Baseline (v18's prologue): every CTA requests its first state before
    griddepcontrol.wait (v19 leaves some of those requests until after the first window)."""
    source = _replace_once(
        source,
        [
            (EARLY_RULE, ""),
            (
                "            if early & (first_slot > Int64(null_slot)):\n",
                "            if first_slot > Int64(null_slot):\n",
            ),
        ],
        "early-states",
        V19_REQUESTS,
    )
    late = source.rindex("        # The other CTAs' first state", 0, source.index(LATE_REQUEST))
    end = _call_end(source, source.index("self.load_state(", late))
    if source.startswith("                load_stage = Int32(1)\n", end):
        end = source.index("\n", end) + 1
    return source[:late] + source[end:]


def late_third(source: str) -> str:
    """Experiment (v19 without its one-wave rule): the grid bound's last SMS CTAs request their
    first state after their first window in every launch, one-wave launches included."""
    return _replace_once(source, [(ONE_WAVE_RULE, "")], "late-third", V19_REQUESTS)


def first_state_after_inputs(source: str, guard: str = "") -> str:
    """Experiment (on v18's prologue): request the first unit's state after its inputs (meta,
    activations) are requested, instead of in the prologue; with ``guard``, only in CTAs where
    it holds (the others keep the prologue load)."""
    if LATE_REQUEST in source:
        source = early_states(source)
    head = source.index(PROLOGUE_LOAD)
    end = _call_end(source, head)
    block = source[head:end]
    late = block.replace("if warp == 0:", f"if (warp == 0){' & (' + guard + ')' if guard else ''}:")
    late = late.replace("first_slot", "slot")
    early = block.replace("if warp == 0:", f"if (warp == 0) & ~({guard}):") if guard else ""
    source = source[:head] + early + source[end:]
    anchor = _first_load_end(source)
    return source[:anchor] + late + source[anchor:]


COLD_FLAG_HELPERS = '''

@cute.jit
def mark_shared(address: Int32):
    """A volatile store of 1 to a shared int32 flag (trace_verify.py: cold-after-inputs)."""
    cute.arch.inline_ptx("st.volatile.shared.u32 [{$r0}], 1;", read_only_args=[address])


@cute.jit
def read_shared(address: Int32) -> Int32:
    """A volatile load of a shared int32 flag (trace_verify.py: cold-after-inputs)."""
    return cute.arch.inline_ptx(
        "ld.volatile.shared.u32 {$w0}, [{$r0}];", write_only_types=[Int32], read_only_args=[address]
    )

'''


def cold_after_inputs(source: str) -> str:
    """Experiment: ``after-inputs`` only where the launch starts cold. Warps 1-3 mark a
    shared flag once griddepcontrol.wait returns; warp 0 reads it when its first slot has
    arrived (the read sits behind the slot's test, and a volatile load is not hoisted). Set:
    no kernel ahead was still running, so the first state is requested after the first
    unit's meta and window loads, which would otherwise queue behind every CTA's state.
    Clear: the prologue load, under the kernel ahead, as v18 shipped."""
    source = early_states(source)
    source = _insert(source, "class Kda", COLD_FLAG_HELPERS, after=False)
    edits = [
        (
            "        next_unit = alloc(smem, Int32, (1,))\n",
            "        next_unit = alloc(smem, Int32, (1,))\n        cold_flag = alloc(smem, Int32, (1,))\n",
        ),
        (
            "            next_unit[0] = units  # past the end until a ticket names a unit\n",
            "            next_unit[0] = units  # past the end until a ticket names a unit\n"
            "            cold_flag[0] = 0\n",
        ),
        (
            PROLOGUE_LOAD,
            "        cold_word = Int32(0)\n"
            "        if warp == 0:  # noqa: SIM102\n"
            "            if first_slot > Int64(null_slot):\n"
            "                cold_word = read_shared(shared_address(cold_flag.iterator))\n"
            "        cold_start = cold_word != 0\n" + PROLOGUE_LOAD,
        ),
        (
            LAUNCH_DEPENDENTS,
            LAUNCH_DEPENDENTS
            + "        if tid == 32:\n            mark_shared(shared_address(cold_flag.iterator))\n",
        ),
    ]
    source = _replace_once(source, edits, "cold-after-inputs", "a one-stage PDL sm90_wgmma variant")
    return first_state_after_inputs(source, "cold_start")


def prefetch_after(source: str) -> str:
    """Experiment: at the end of each unit, an L2 prefetch of the state of the unit after
    next (its TMA load is issued a unit later), so the state stream runs a unit deeper."""
    lines = source.split("\n")
    at = next(i for i, line in enumerate(lines) if "unit, nxt = nxt, after" in line)
    lines[at:at] = [
        "            if tid == 32:  # noqa: SIM102 (one thread: a prefetch does not elect)",
        "                if (after < units) & (after_slot > Int64(null_slot)):",
        "                    self.prefetch_state(",
        "                        tma_atom, tma_tensor, s_state, after_slot, after % H, 0",
        "                    )",
    ]
    return "\n".join(lines)


def prefetch_second_wave(source: str) -> str:
    """Experiment: ``prefetch_after``, and in the prologue each CTA prefetches the state of
    unit cta + ctas: the second wave (tickets hand out units ctas..2 ctas - 1 first)."""
    source = prefetch_after(source)
    return _insert(
        source,
        "cute.arch.griddepcontrol_wait()",
        (
            "        if tid == 32:  # noqa: SIM102\n"
            "            if cta + ctas < units:\n"
            "                wave2_slot = Int64(slots[(cta + ctas) // H])\n"
            "                if wave2_slot > Int64(null_slot):\n"
            "                    self.prefetch_state(\n"
            "                        tma_atom, tma_tensor, s_state, wave2_slot, (cta + ctas) % H, 0\n"
            "                    )"
        ),
        after=False,
    )


def second_wave_after_inputs(source: str) -> str:
    """Experiment: each CTA reads the slot of unit cta + ctas before the wait, and once its
    first window's loads are out, L2-prefetches that state: the second wave's states (tickets
    hand out units ctas..2 ctas - 1 first) stream while the first units compute, where the
    HBM is otherwise idle, instead of from each CTA's first projection on."""
    source = _insert(
        source,
        "cute.arch.griddepcontrol_wait()",
        (
            "        wave2_slot = Int64(null_slot)\n"
            "        if tid == 32:  # noqa: SIM102\n"
            "            if cta + ctas < units:\n"
            "                wave2_slot = Int64(slots[(cta + ctas) // H])"
        ),
        after=False,
    )
    issued = _first_load_end(source)
    prefetch = (
        "        if tid == 32:  # noqa: SIM102 (one thread: a prefetch does not elect)\n"
        "            if wave2_slot > Int64(null_slot):\n"
        "                self.prefetch_state(\n"
        "                    tma_atom, tma_tensor, s_state, wave2_slot, (cta + ctas) % H, 0\n"
        "                )\n"
    )
    return source[:issued] + prefetch + source[issued:]


def _replace_once(source: str, edits: list[tuple[str, str]], config: str, needs: str) -> str:
    """Apply each (old, new) edit to the one place ``old`` occurs in the render; a render
    without exactly one is not the kind ``config`` patches (``needs`` says which is)."""
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"trace: {config} needs {needs}")
        source = source.replace(old, new)
    return source


CONV_BF16 = "a bf16-tap conv variant (sm90_wgmma)"
ONE_WARPGROUP = "a one-warpgroup sm90_wgmma variant"

# The prologue's input prefetch as rendered: v8's grid-wide one in one-wave launches, v11's
# own first window in launches of more than two waves.
INPUT_PREFETCH = (
    "        if units <= ctas:\n"
    "            self.prefetch_first_inputs(tensors, first_slot, null_slot)\n"
)
OWN_WINDOW = "        elif units > 2 * ctas:\n            self.prefetch_own_window(tensors)\n"
GUARDED_PREFETCH = "a PDL variant with the guarded input prefetch (sm90_wgmma)"


def _input_prefetch_as(source: str, replacement: str, config: str) -> str:
    return _replace_once(
        source, [(INPUT_PREFETCH + OWN_WINDOW, replacement)], config, GUARDED_PREFETCH
    )


def without_input_prefetch(source: str) -> str:
    """v7's prologue: no L2 prefetch of the first units' inputs before griddepcontrol.wait."""
    return _input_prefetch_as(source, "", "no-prefetch")


def input_prefetch_always(source: str) -> str:
    """v8's input prefetch at every batch, not only in one-wave launches."""
    always = INPUT_PREFETCH.replace("units <= ctas", "True")
    return _input_prefetch_as(source, always, "prefetch-always")


LAUNCH_DEPENDENTS = "        cute.arch.griddepcontrol_launch_dependents()\n"


def input_prefetch_after_wait(source: str) -> str:
    """Experiment: launches of more than one wave prefetch the first units' inputs right
    after griddepcontrol.wait (v8's prefetch was slower before it: its bytes competed with
    the previous launch's tail). The window rows then stream alongside the query_start read
    instead of one round trip after it."""
    after = (
        "        if units > ctas:\n"
        "            self.prefetch_first_inputs(tensors, first_slot, null_slot)\n"
    )
    edit = (LAUNCH_DEPENDENTS, LAUNCH_DEPENDENTS + after)
    return _replace_once(source, [edit], "prefetch-after-wait", "a PDL variant (sm90_wgmma)")


CONV_MATH = "                # Each channel block's Q outputs take the fast SiLU"
# v16's first line after the conv (the running decay's start), where the conv math ends.
RUNNING_DECAY = (
    "                # exp(G_t) as a running product: each token's factor exp(gate_t) on the\n"
    "                # approximate ex2 stays within ~2 ulp, as |gate_t| <= |lower_bound| keeps its\n"
    "                # argument small (an accurate exp of the summed G costs 8 instructions a token).\n"
    "                decay = Float32(1)\n"
)
CONV_MATH_END = RUNNING_DECAY


def conv_bytes_only(source: str) -> str:
    """Timing bound, wrong outputs: a conv kernel's loads and stores (history, taps, window,
    rolled state, kg) without its arithmetic (the raw window stands in for the conv output):
    how fast the conv kernel could be with its math hidden, against conv off."""
    if CONV_MATH not in source:
        raise SystemExit("trace: conv-bytes-only needs a bf16-tap conv variant (sm90_wgmma)")
    head = source.index(CONV_MATH)
    return source[:head] + source[source.index(CONV_MATH_END, head) :]


def conv_without_silu(source: str) -> str:
    """Timing bound, wrong outputs: the conv's products and sums without its SiLUs."""
    fast = "                            y, doubt = silu_fast(acc)\n"
    plain = "                            y, doubt = acc, Int32(0)\n"
    return _replace_once(source, [(fast, plain)], "conv-no-silu", CONV_BF16)


SILU_DOUBT = "                            doubts = doubts | (doubt << (t + h))\n"


def silu_without_test(source: str) -> str:
    """Timing bound, rounding not settled: the fast SiLU without its doubt test and the
    exact form (ptxas drops the unused test)."""
    return _replace_once(source, [(SILU_DOUBT, "")], "silu-no-test", CONV_BF16)


def silu_settled_kv(source: str) -> str:
    """Experiment (wrong roundings of q): the doubted roundings of k and v settled, q's fast
    result kept. Fails the check's element-wise out bound (v9 in the perf notes)."""
    doubt_kv = SILU_DOUBT.replace("(doubt << ", "((doubt if x > 0 else Int32(0)) << ")
    return _replace_once(source, [(SILU_DOUBT, doubt_kv)], "silu-settle-kv", CONV_BF16)


def own_window_prefetch(source: str) -> str:
    """Experiment (v10; v11 ships it from three waves on): every launch of more than one
    wave prefetches, before griddepcontrol.wait, each CTA's own first window (guessed at its
    full-window rows) and query_start line, two-wave launches too."""
    edit = (OWN_WINDOW, OWN_WINDOW.replace("elif units > 2 * ctas:", "else:"))
    return _replace_once(source, [edit], "own-window", GUARDED_PREFETCH)


def query_start_prefetch(source: str) -> str:
    """Experiment: two-wave launches (those without v11's own-window prefetch) prefetch,
    before griddepcontrol.wait, only each CTA's first ``query_start`` line (and, with conv,
    its ``accepted`` line): the meta whose round trip after the wait gates the first
    window's loads. (Measured on v10's render, where it applied to every multi-wave launch.)"""
    line = "                prefetch_l2_line(at(tensors[8], cta // H))\n"
    if "tensors[12]" in source:
        line += "                prefetch_l2_line(at(tensors[12], cta // H))\n"
    meta = "        else:\n            if tid == THREADS - 1:\n" + line
    return _replace_once(
        source,
        [(INPUT_PREFETCH + OWN_WINDOW, INPUT_PREFETCH + OWN_WINDOW + meta)],
        "qs-prefetch",
        "a one-unit-per-CTA PDL variant (sm90_wgmma, no row split)",
    )


def beta_at_load(source: str) -> str:
    """Baseline (v12's placement): the raw beta converted to fp32 as it is loaded, so warp 0
    waits at the end of each look-ahead for the beta's round trip (v13 converts at use)."""
    return _replace_once(
        source,
        [
            (
                "beta_raw = cute.make_rmem_tensor((1,), cutlass.BFloat16)",
                "beta_raw = cute.make_rmem_tensor((1,), Float32)",
            ),
            (
                "beta_raw[0] = raw_beta[bos + tid, head]\n",
                "beta_raw[0] = raw_beta[bos + tid, head].to(Float32)\n",
            ),
        ],
        "beta-at-load",
        "a v13 sm90_wgmma render",
    )


# v14's lane-parallel inverse norms, as rendered (one-warpgroup and two-warpgroup slots).
INVERSE_NORMS = re.compile(
    r" +# Each lane totals one squared norm.*?\)  # q's scale folded in\n", re.DOTALL
)
SHUFFLED_NORM = re.compile(
    r"(?P<x>[qk])_n = (?P=x)v\[(?P<slot>\w)\] \* cute\.arch\.shuffle_sync\(inv_norm, .*?\)\n"
)


def v13_probes(source: str) -> str:
    """Baseline (v13's probes, on ``accurate-decay``'s v14 decays): every thread sums each
    token's squared norms over the 4 channel quarters and takes both rsqrt itself, and w_t
    takes a second accurate exp, exp(-G), where v14 shuffles a lane's inverse norm and takes
    1 / exp(G)."""
    needs = "a v16 sm90_wgmma render"
    source, found = INVERSE_NORMS.subn("", accurate_decay(source))  # v13's decays too
    if found != 1:
        raise SystemExit(f"trace: v13-probes needs {needs}")

    def per_thread(match: re.Match) -> str:
        x, slot = match["x"], match["slot"]
        index = f"2 * {slot}" + (" + 1" if x == "k" else "")
        scale = " * Float32(K**-0.5)" if x == "q" else ""
        pairs = [f"norms[{a}, {index}] + norms[{a + 1}, {index}]" for a in (0, 2)]
        total = f"({pairs[0]}) + ({pairs[1]})"
        inverse = f"cute.math.rsqrt(s{x} + Float32(1e-6), fastmath=True)"
        return f"s{x} = {total}\n{' ' * 20}{x}_n = {x}v[{slot}] * {inverse}{scale}\n"

    source, count = SHUFFLED_NORM.subn(per_thread, source)
    if count != 2:
        raise SystemExit(f"trace: v13-probes needs {needs}")
    slot = "j" if "decays[j]" in source else "t"
    return _replace_once(
        source,
        [("cute.arch.rcp_approx(decay) * k_n,", f"cute.math.exp(-decays[{slot}]) * k_n,")],
        "v13-probes",
        needs,
    )


def lazy_meta(source: str) -> str:
    """Experiment (v13's render): ``unit_meta`` returns a request's raw ``query_start[r + 1]``
    (and, with conv, its raw accepted count), and each unit's qlen (and conv history row) is
    derived where it is used: at the look-ahead and at the rotation a unit later. As rendered,
    the subtraction for the unit after next sits at the end of the loop body, so every warp
    waits there for that request's reads, issued after the projections barrier."""
    needs = "a one-stage sm90_wgmma render with v13's meta rotation"
    conv = "next_first" in source
    edits = [
        (
            "        qlen = query_start[request + 1] - bos\n",
            "        qlen = query_start[request + 1]  # lazy-meta: the end; callers subtract bos\n",
        ),
        (
            "tensors, next_slot, next_bos, next_qlen,",
            "tensors, next_slot, next_bos, next_qlen - next_bos,",
        ),
    ]
    first, rotate = (
        "slot, bos, qlen = self.unit_meta(",
        "slot, bos, qlen = next_slot, next_bos, next_qlen",
    )
    if conv:
        edits += [
            (
                "first = tensors[12][request] - 1  # accepted tokens - 1",
                "first = tensors[12][request]",
            ),
            ("next_qlen - next_bos, next_first,", "next_qlen - next_bos, next_first - 1,"),
        ]
        first = "slot, bos, qlen, first = self.unit_meta("
        rotate = "slot, bos, qlen, first = next_slot, next_bos, next_qlen, next_first"
    source = _replace_once(source, edits, "lazy-meta", needs)
    head = source.index("        " + first)
    end = source.index("\n", head) + 1
    fix = "        qlen = qlen - bos\n" + ("        first = first - 1\n" if conv else "")
    source = source[:end] + fix + source[end:]
    derived = rotate.replace("next_qlen", "next_qlen - next_bos")
    if conv:
        derived = derived.replace("next_first", "next_first - 1")
    return _replace_once(source, [(rotate + "\n", derived + "\n")], "lazy-meta", needs)


def second_meta_prefetch(source: str) -> str:
    """Experiment (v12's render): multi-wave launches also prefetch, before
    griddepcontrol.wait, the ``query_start`` and ``slots`` lines of each CTA's static second
    unit (read right after the wait with the first's), and two-wave launches the first
    unit's ``query_start`` line (which v11's own-window prefetch covers from three waves on)."""
    second = "cutlass.min(cta + ctas, units - 1) // H"
    lines = (
        "        if units > ctas:\n"
        "            if tid == THREADS - 2:\n"
        f"                prefetch_l2_line(at(tensors[8], {second}))\n"
        "            if tid == THREADS - 3:\n"
        f"                prefetch_l2_line(at(tensors[9], {second}))\n"
        "            if (tid == THREADS - 4) & (units <= 2 * ctas):\n"
        "                prefetch_l2_line(at(tensors[8], cta // H))\n"
    )
    return _replace_once(
        source,
        [(INPUT_PREFETCH + OWN_WINDOW, INPUT_PREFETCH + OWN_WINDOW + lines)],
        "second-meta-prefetch",
        "a PDL variant (sm90_wgmma, no row split) of v12 on",
    )


def first_lookahead_late(source: str, at_end: bool = False) -> str:
    """Experiment: a CTA's first unit issues the next unit's input loads after its coupling
    barrier (``at_end``: after its stores), not after its norms barrier, where its threads
    stall until the ticket's meta (atomic, then ``slots`` and ``query_start``) returns;
    later units keep the early issue."""
    head, end = _lookahead_block(source)
    block = source[head:end]
    needs = ONE_WARPGROUP
    if block.count("            if nxt < units:\n") != 1:
        raise SystemExit(f"trace: first-lookahead-late needs {needs}")
    later = block.replace("if nxt < units:", "if (nxt < units) & (unit != cta):")
    first = block.replace("if nxt < units:", "if (nxt < units) & (unit == cta):")
    first = first.replace("# The registers are free", "# The first unit's look-ahead")
    source = source[:head] + later + source[end:]
    if at_end:  # after the unit's solve and stores
        rotate = "            unit, nxt = nxt, after\n"
        return _replace_once(source, [(rotate, first + rotate)], "first-lookahead-end", needs)
    barrier = "            cute.arch.barrier()  # probes and coupling partials\n"
    return _replace_once(source, [(barrier, barrier + first)], "first-lookahead-late", needs)


WINDOW_TMAS = """\
        # tma-window: the window's q, k, v and g through TMA, one (Q, K) box per tensor.
        window_sources = tuple(
            cute.make_tensor(
                ptr,
                cute.make_layout(
                    (tokens, H * K), stride=(cute.assume(act_stride, divby=8), 1)
                ),
            )
            for ptr in (q_ptr, k_ptr, v_ptr)
        ) + (row_major(raw_g_ptr, tokens, H * K),)
        window_tmas = tuple(
            cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), source,
                cute.make_layout((Q, K), stride=(K, 1)), (Q, K),
            )
            for source in window_sources
        )
"""

LOAD_WINDOW_METHOD = """\
    @cute.jit
    def load_window(self, window_tmas: tuple, s_window, window_full, bos, head, lane):
        \"\"\"Warp-wide: TMA rows [bos, bos + Q) of the head's q, k, v and g into s_window.\"\"\"
        barrier = window_full.iterator
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(barrier, 4 * Q * K * 2)
        cute.arch.sync_warp()
        for x in cutlass.range_constexpr(4):
            atom, tensor = window_tmas[x]
            g_window = cute.local_tile(
                cute.domain_offset((bos, head * K), tensor), (Q, K), (0, 0)
            )
            t_smem, t_gmem = cpasync.tma_partition(
                atom, 0, cute.make_layout(1),
                cute.group_modes(s_window[None, None, x], 0, 2),
                cute.group_modes(g_window, 0, 2),
            )
            cute.copy(atom, t_gmem, t_smem, tma_bar_ptr=barrier)

"""

WINDOW_FROM_SMEM = """\
            if live:
                cute.arch.mbarrier_wait(window_full.iterator, window_phase)
                window_phase = window_phase ^ 1
                for t in cutlass.range_constexpr(Q):
                    for x in cutlass.range_constexpr(3):
                        raw[x, t] = s_window[t, c, x]
                    g_raw[t] = s_window[t, c, 3]
"""


def tma_window(source: str, late: bool = False) -> str:
    """Experiment: each unit's window (q, k, v, g) arrives by TMA, four (Q, K) boxes on one
    mbarrier issued by warp 0, instead of 4 Q loads per thread; the unit copies its channel
    from shared memory at its top. The look-ahead is issued where v11 issues its loads
    (after the norms barrier), or (``late``) with the next state after the projections
    barrier, where the next unit's meta is known even for the first unit."""
    needs = "a conv-off one-warpgroup sm90_wgmma variant without row split"
    loads = (
        "            for t in cutlass.range_constexpr(Q):\n"
        "                row = bos + cutlass.min(t, qlen - 1)\n"
        "                for x in cutlass.range_constexpr(3):\n"
        "                    raw[x, t] = acts[x][row, head * K + c]\n"
        "                g_raw[t] = raw_g[row, head * K + c]\n"
    )
    tma = (
        "            if tid // 32 == 0:\n"
        "                self.load_window(window_tmas, s_window, window_full, bos, head, tid % 32)\n"
    )
    edits = [
        ("        activations = tuple(\n", WINDOW_TMAS + "        activations = tuple(\n"),
        (
            "            a_layout, b_layout,\n        ).launch(",
            "            a_layout, b_layout, window_tmas,\n        ).launch(",
        ),
        (
            "        b_layout: cute.ComposedLayout,\n    ):",
            "        b_layout: cute.ComposedLayout,\n        window_tmas: tuple,\n    ):",
        ),
        (
            "    @cute.jit\n    def unit_meta(",
            LOAD_WINDOW_METHOD + "    @cute.jit\n    def unit_meta(",
        ),
        (
            "        next_unit = alloc(smem, Int32, (1,))\n",
            "        next_unit = alloc(smem, Int32, (1,))\n"
            "        window_full = alloc(smem, Int64, (1,), align=8)\n"
            "        s_window = smem.allocate_tensor(\n"
            "            cutlass.BFloat16, cute.make_layout((Q, K, 4), stride=(K, 1, Q * K)),\n"
            "            byte_alignment=128,\n"
            "        )\n",
        ),
        (
            "            cute.arch.mbarrier_init_fence()\n",
            "            cute.arch.mbarrier_init(window_full.iterator, 1)\n"
            "            cute.arch.mbarrier_init_fence()\n",
        ),
        (
            "        gate_in: cute.Tensor, beta_raw: cute.Tensor,\n    ):  # fmt: skip",
            "        gate_in: cute.Tensor, beta_raw: cute.Tensor, window_tmas: tuple, s_window: cute.Tensor,\n        window_full: cute.Tensor,\n    ):  # fmt: skip",
        ),
        (loads, tma),
        (
            "gate_in,\n            beta_raw,\n        )  # fmt: skip",
            "gate_in,\n            beta_raw, window_tmas, s_window, window_full,\n        )  # fmt: skip",
        ),
        (
            "                    gate_in, beta_raw,\n                )  # fmt: skip",
            "                    gate_in, beta_raw, window_tmas, s_window, window_full,\n                )  # fmt: skip",
        ),
        (
            "        state_phase = Int32(0)\n",
            "        state_phase = Int32(0)\n        window_phase = Int32(0)\n",
        ),
        (
            "            if live:\n                # ---- 2. Activations",
            WINDOW_FROM_SMEM + "            if live:\n                # ---- 2. Activations",
        ),
    ]
    source = _replace_once(source, edits, "tma-window", needs)
    if late:
        head, end = _lookahead_block(source)
        block = source[head:end].replace(
            "# The registers are free: the next unit's inputs load under this unit.",
            "# The next unit's window and scalars, with its state.",
        )
        source = source[:head] + source[end:]
        anchor = "            after_slot, after_bos, after_qlen = self.unit_meta(tensors, after, units)\n"
        source = _replace_once(source, [(anchor, block + anchor)], "tma-window-late", needs)
    return source


def reads_only(source: str) -> str:
    """Timing bound, wrong outputs: every unit's reads (state, window, request) and none of
    its math or stores (no unit is live): how fast the reads alone stream."""
    live = "            live = valid & (qlen > 0)\n"
    never = "            live = valid & (qlen < 0)\n"
    return _replace_once(source, [(live, never)], "reads-only", "an sm90_wgmma variant")


def without_stores(source: str) -> str:
    """Timing bound, wrong outputs: the math without the stores of kg, out and corr (each
    store behind a run-time test that never holds, so the math stays; v18's predicated
    solve stores get a predicate that is never positive, qlen - t - Q)."""
    solve_stores = "qlen - t, at(out, bos + t, head * K + c), o,"
    predicated = source.count(solve_stores)  # one call stores out and corr
    source = source.replace(solve_stores, "qlen - t - Q, at(out, bos + t, head * K + c), o,")
    lines = source.split("\n")
    wrapped = []
    for line in lines:
        body = line.strip()
        if body.startswith(("kg[record, head, t", "corr[record, head, t", "out[bos + t")) and (
            "element_type(0)" not in body
        ):
            indent = line[: len(line) - len(line.lstrip())]
            wrapped += [f"{indent}if qlen > Q:", f"    {line}"]
        else:
            wrapped.append(line)
    if len(wrapped) - len(lines) + 2 * predicated < 4:  # kg (k and g), out and corr
        raise SystemExit("trace: no-stores needs an sm90_wgmma variant")
    return "\n".join(wrapped)


IO_STORES = """\
            if valid & (qlen > 0):
                for t in cutlass.range_constexpr(Q):
                    if t < qlen:
                        kg[record, head, t, c] = raw[1, t]
                        kg[record, head, t, K + c] = g_raw[t]
                        out[bos + t, head * K + c] = raw[0, t]
                        corr[record, head, t, c] = raw[2, t].to(Float32)
"""


def io_only(source: str) -> str:
    """Timing bound, wrong outputs: ``reads-only`` plus every store of a live unit (kg,
    out, corr; values from the input registers): the memory traffic alone, in the kernel's
    own pattern, with none of the math between the reads and the stores."""
    null = "            if slot <= Int64(null_slot):\n"
    edits = [(null, IO_STORES + null)]
    return reads_only(_replace_once(source, edits, "io-only", ONE_WARPGROUP))


def l2_resident(source: str, spread: int = 1) -> str:
    """Timing bound, wrong outputs: every unit reads and writes the rows of request b mod
    ``spread`` (its state slot, window and meta, and its kg, corr and out rows), which stay in
    L2 across the benchmark's input sets: the kernel's schedule and math with (almost) no HBM
    traffic. With ``spread`` 1 every CTA of a head reads the same lines (L2 hot spots);
    ``l2-spread`` (4) spreads them over 4x as many."""
    edits = [
        (
            "        request = cutlass.min(unit, units - 1) // H\n",
            f"        request = cutlass.min(unit, units - 1) // H % {spread}\n",
        ),
        (
            "        first_slot = Int64(slots[cta // H])\n",
            f"        first_slot = Int64(slots[cta // H % {spread}])\n",
        ),
        (
            "            record = request  # the corr / kg row of this request\n",
            f"            record = request % {spread}  # the corr / kg row of this request\n",
        ),
    ]
    return _replace_once(source, edits, "l2-resident", "a one-warpgroup r1 sm90_wgmma variant")


HI_ONLY_HELPERS = '''

from kdagen.dsl.common import store_shared  # noqa: E402 (trace_verify.py: probe-hi-only)


@cute.jit
def store_bf16_hi_only(value: Float32, hi_address: Int32, lo_address: Int32):
    """store_bf16_split without the lo half's store (trace_verify.py: probe-hi-only)."""
    store_shared(hi_address, value.to(cutlass.BFloat16))


@cute.jit
def store_bf16_hi_twice(value: Float32, hi_address: Int32, lo_address: Int32):
    """store_bf16_split with the hi half stored in the lo's place too: every store, none of
    the lo half's arithmetic (trace_verify.py: probe-lo-as-hi)."""
    hi = value.to(cutlass.BFloat16)
    store_shared(hi_address, hi)
    store_shared(lo_address, hi)

'''


def probe_halves(source: str, store: str, config: str) -> str:
    """Every ``store_bf16_split`` of the kernel (the probes' and w rows' hi and lo halves)
    replaced by the helper ``store``."""
    body = source.index("    def kernel(")
    if source.count("store_bf16_split(", body) < 2:
        raise SystemExit(f"trace: {config} needs an sm90_wgmma variant")
    source = source[:body] + source[body:].replace("store_bf16_split(", f"{store}(")
    return _insert(source, "class Kda", HI_ONLY_HELPERS, after=False)


def probe_hi_only(source: str) -> str:
    """Timing bound, wrong outputs: the probes' and w rows' lo halves are neither computed nor
    stored (half of the probe phase's shared-memory stores, ~70 instructions fewer)."""
    return probe_halves(source, "store_bf16_hi_only", "probe-hi-only")


def probe_lo_as_hi(source: str) -> str:
    """Timing bound, wrong outputs: every store of ``probe-hi-only``'s kept, the lo halves'
    arithmetic dropped (the hi half written in their place): with ``probe-hi-only``, says
    whether the stores or the arithmetic cost the probe phase (v17's question)."""
    return probe_halves(source, "store_bf16_hi_twice", "probe-lo-as-hi")


PROBE_FENCE = (
    "                proxy_fence()\n"
    "                cute.arch.sync_warp()  # this warp's w rows and probe channels, for ldmatrix\n"
)
KG_STORES = (
    "                        kg[record, head, t, c] = raw[1, t]\n"
    "                        kg[record, head, t, K + c] = g_raw[t]\n"
)


def lookahead_after_fence(source: str, kg_too: bool = False) -> str:
    """Experiment (measured, not kept: +0.5 to +0.8 us at B = 64): the next unit's input
    loads and state prefetch are issued after the probe phase's proxy fence instead of
    before the probes. The fence compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S; if the
    MEMBAR waited for the thread's outstanding global loads, every unit with a look-ahead
    would wait there for the next unit's window (``no-fence`` showed it does not). ``kg_too``
    (``io-after-fence``): the kg stores move behind the fence as well (before the look-ahead
    overwrites their registers), in case it waits for stores."""
    config = "io-after-fence" if kg_too else "lookahead-after-fence"
    head, end = _lookahead_block(source)
    one_stage = "self.prefetch_state(" in source[end:]
    if not one_stage or source.count(PROBE_FENCE) != 1:
        raise SystemExit(f"trace: {config} needs a one-stage one-warpgroup sm90_wgmma variant")
    end = _call_end(source, source.index("self.prefetch_state(", end))
    block = source[head:end]
    if PROBE_FENCE not in source[end:]:
        raise SystemExit(f"trace: {config} needs a one-stage one-warpgroup sm90_wgmma variant")
    source = source[:head] + source[end:]
    moved = block + "            if live:\n"
    if kg_too:
        source = _replace_once(source, [(KG_STORES, "")], config, ONE_WARPGROUP)
        kg = (
            "                for t in cutlass.range_constexpr(Q):\n"
            "                    if t < qlen:\n" + KG_STORES
        )
        moved = kg + moved
    return source.replace(PROBE_FENCE, PROBE_FENCE + moved)


def without_probe_fence(source: str) -> str:
    """Timing bound, racy outputs: the probe phase without its proxy fence (MEMBAR.ALL.CTA +
    FENCE.VIEW.ASYNC.S): what the fence costs at most, wherever its wait comes from."""
    fence = "                proxy_fence()\n"
    return _replace_once(source, [(fence, "")], "no-fence", ONE_WARPGROUP)


WINDOW_LOOP = """\
            for t in cutlass.range_constexpr(Q):
                row = bos + cutlass.min(t, qlen - 1)
                for x in cutlass.range_constexpr(3):
                    raw[x, t] = acts[x][row, head * K + c]
                g_raw[t] = raw_g[row, head * K + c]
"""
WIDE_WINDOW = """\
            # lookahead-wide: 4 vector loads of 16 bytes (token tid % 8, channels 8 (tid // 8)
            # of the head), the window's bytes in the wrong registers.
            row = bos + cutlass.min(tid % 8, qlen - 1)
            column = head * K + tid // 8 * 8
            raw_bits = cute.recast_tensor(raw, cutlass.Uint16)
            g_bits = cute.recast_tensor(g_raw, cutlass.Uint16)
            for x in cutlass.range_constexpr(4):
                words = load_words(at(raw_g if x == 3 else acts[x], row, column), count=4)
                for t in cutlass.range_constexpr(Q):
                    half = cutlass.Uint16(words[t // 2] >> (16 * (t % 2)))
                    if x == 3:
                        g_bits[t] = half
                    else:
                        raw_bits[x, t] = half
"""


def lookahead_wide(source: str) -> str:
    """Timing bound, wrong outputs: each unit's window (q, k, v, g) arrives by 4 16-byte
    loads per thread, as a token-major thread layout would load it, instead of 32 two-byte
    loads and their 64-bit addresses: what the loads' instructions cost the probe phase.
    (Measured: 1-1.5 us slower at B = 64, 11 us at B = 256: the vector loads stream worse.)"""
    imports = "from kdagen.dsl.common import (\n"
    edits = [(WINDOW_LOOP, WIDE_WINDOW), (imports, imports + "    load_words,\n")]
    return _replace_once(source, edits, "lookahead-wide", ONE_WARPGROUP)


FIRST_META = "        slot, bos, qlen = self.unit_meta(tensors, unit, units)\n"
FIRST_LOAD_ARGS = (
    "            tensors, slot, bos, qlen, unit % H, null_slot, raw, g_raw, gate_in,\n"
)


def window_guess(source: str, miss: bool = False) -> str:
    """Experiment (measured, not kept: no gain; the meta and window drain together behind
    the first states): the first unit's window is loaded right after griddepcontrol.wait at the
    rows it has when every earlier request holds Q tokens (rows [b Q, (b + 1) Q)), in
    parallel with its meta instead of after it; once the meta arrives, a unit whose window
    starts elsewhere or holds fewer than Q tokens loads it again (``load_activations`` with
    its real meta), so outputs cannot change. ``miss`` (``window-misguess``): every guess
    one row off, the cost of a wrong guess (its bytes and the serial reload)."""
    config = "window-misguess" if miss else "window-guess"
    needs = "a conv-off one-warpgroup r1 sm90_wgmma variant"
    if "\nOWN = " in source:  # two warpgroups hold other token slots in ``raw``
        raise SystemExit(f"trace: {config} needs {needs}")
    guess = "cta // H * Q + 1" if miss else "cta // H * Q"
    edits = [
        (
            FIRST_META,
            FIRST_META
            + f"        guess = {guess}  # {config}\n"
            + "        self.load_activations(  # the guessed rows, clamped to the tokens\n"
            + "            tensors, first_slot, guess, cutlass.min(Q, tensors[1].shape[0] - guess),\n"
            + "            unit % H, null_slot, raw, g_raw, gate_in, beta_raw,\n"
            + "        )  # fmt: skip\n"
            + "        reload_qlen = qlen  # 0: the guessed rows are the window, no reload\n"
            + "        if (bos == guess) & (qlen == Q):\n"
            + "            reload_qlen = Int32(0)\n",
        ),
        (FIRST_LOAD_ARGS, FIRST_LOAD_ARGS.replace(" qlen,", " reload_qlen,")),
    ]
    return _replace_once(source, edits, config, needs)


EVICT_FIRST = "Int64(0x12F0000000000000)"  # the L2 cache-hint operand of EVICT_FIRST


def state_evict_first(source: str) -> str:
    """Experiment: the state's TMA loads carry an L2 evict-first hint, so the streamed
    states (read once) do not push the kernel's code and small inputs out of L2."""
    tma = "cute.copy(tma_atom, t_gmem, t_smem[None, stage], tma_bar_ptr=barrier)"
    hinted = tma[:-1] + f", cache_policy={EVICT_FIRST})"
    return _replace_once(source, [(tma, hinted)], "state-evict-first", "an sm90_wgmma variant")


def probe_first_state(source: str) -> str:
    """Trace-only (with --trace): every thread waits for its first state right after
    griddepcontrol.wait and records when it landed (header field 4). It delays the first
    unit's input reads until then, so it shows the first states' delivery on their own."""
    probe = (
        "        if first_slot > Int64(null_slot):\n"
        "            probe_barrier = state_full.iterator  # not the trace's anchor\n"
        "            cute.arch.mbarrier_wait(probe_barrier, 0)\n"
        "        trace_put(4, cute.arch.globaltimer())\n"
    )
    edit = (LAUNCH_DEPENDENTS, LAUNCH_DEPENDENTS + probe)
    return _replace_once(source, [edit], "state-probe", "a PDL variant (sm90_wgmma)")


SERIAL_COUPLING = [
    (
        """                # Every n-tile's fragments, then every MMA, then the stores: for the compiler
                # a partial store may alias the probe tile, so an ldmatrix after one waited
                # for it and each n-tile paid its own load and MMA latencies in turn.
                b_frags = []
                for nt in cutlass.range_constexpr(COLS // 8):
                    b_frags.append(ldmatrix_x4(b_base + nt * 1024))
                sums = []
                for nt in cutlass.range_constexpr(COLS // 8):
                    b = b_frags[nt]
""",
        """                for nt in cutlass.range_constexpr(COLS // 8):
                    b = ldmatrix_x4(b_base + nt * 1024)
""",
    ),
    (
        """                    sums.append((d[0] + d[1]) + (d[2] + d[3]))
                for nt in cutlass.range_constexpr(COLS // 8):
                    partial[warp, (4 * nt + t4) * 8 + g] = sums[nt]
""",
        """                    partial[warp, (4 * nt + t4) * 8 + g] = (d[0] + d[1]) + (d[2] + d[3])
""",
    ),
]


def serial_coupling(source: str) -> str:
    """Baseline (v16's coupling MMAs): each n-tile's ldmatrix, two MMAs and partial store in
    turn, so the next n-tile's ldmatrix waits behind the store (v18 loads every fragment
    first)."""
    return _replace_once(source, SERIAL_COUPLING, "serial-coupling", ONE_WARPGROUP)


BRANCH_STORES = [
    (
        """                    # Stored where t < qlen, without a branch (store_token_row says why).
                    store_token_row(
                        qlen - t, at(out, bos + t, head * K + c), o,
                        at(corr, record, head, t, c), u[t],
                    )  # fmt: skip
""",
        """                    if t < qlen:
                        out[bos + t, head * K + c] = o.to(out.element_type)
                        corr[record, head, t, c] = u[t]
""",
    ),
]


def branch_stores(source: str) -> str:
    """Baseline (v16's solve stores): each token's out and corr behind its own ``if t <
    qlen``, into which the compiler sinks that token's shared loads and FMAs (v18's conv-off
    renders store through predicated stores; the conv ones kept the branch)."""
    needs = "a conv-off one-warpgroup sm90_wgmma variant"
    return _replace_once(source, BRANCH_STORES, "branch-stores", needs)


def norms_free(source: str) -> str:
    """Timing bound, wrong outputs (unnormalised probes, racy w rows): no norms barrier and
    no inverse norms in the probe phase. What a unit would gain at most if the probes were
    stored unnormalised and the norms applied after the coupling barrier (to the coupling
    scalars and projections, which are linear in each probe)."""
    needs = ONE_WARPGROUP
    source = _replace_once(
        source, [("            cute.arch.barrier()  # norms and betas\n", "")], "norms-free", needs
    )
    source, found = INVERSE_NORMS.subn("", source)
    source, shuffled = SHUFFLED_NORM.subn(
        lambda m: f"{m['x']}_n = {m['x']}v[{m['slot']}]\n", source
    )
    if (found, shuffled) != (1, 2):
        raise SystemExit(f"trace: norms-free needs {needs}")
    return source


def balanced_grid(source: str) -> str:
    """Experiment (measured, not kept: v16 in the perf notes): the grid keeps the launch's
    number of waves but spreads the units over them evenly (3072 units on 384 CTAs, 8 each,
    instead of 396 CTAs whose last wave has 300 units)."""
    grid = "            grid=(cutlass.min(units, CTAS), 1, 1),\n"
    even = (
        "            grid=((units + (units + CTAS - 1) // CTAS - 1)\n"
        "                  // ((units + CTAS - 1) // CTAS), 1, 1),\n"
    )
    return _replace_once(source, [(grid, even)], "balanced-grid", "an sm90_wgmma variant")


def accurate_decay(source: str) -> str:
    """Baseline: v14's decays, one accurate exp of the cumulative log decay per token
    (``decays`` then holds G), in place of v16's running product of approximate exps."""
    needs = "a v16 sm90_wgmma render"
    edits = [
        (RUNNING_DECAY, "                cum = Float32(0)\n"),
        (
            "                step_scale = lower_bound * Float32(1.4426950408889634)  # ex2 of gate log2(e)\n",
            "",
        ),
        (
            "                    decay = decay * cute.math.exp2(step_scale * gate, fastmath=True)\n",
            "                    cum = cum + lower_bound * gate\n",
        ),
    ]
    source = _replace_once(source, edits, "accurate-decay", needs)
    # The stores into decays and the probes' reads of it (slot t, or j and t // 2 per warpgroup).
    for pattern, replacement in (
        (r"(decays\[[^]]+\]) = decay\n", r"\1 = cum\n"),
        (r"decay = (decays\[\w\])\n", r"decay = cute.math.exp(\1)\n"),
    ):
        source, count = re.subn(pattern, replacement, source)
        if count != 1:
            raise SystemExit(f"trace: accurate-decay needs {needs}")
    return source


CONFIGS = {
    "prologue": lambda s: s,
    "no-prefetch": without_input_prefetch,
    "prefetch-always": input_prefetch_always,
    "prefetch-after-wait": input_prefetch_after_wait,
    "after-inputs": first_state_after_inputs,
    "staggered": lambda s: first_state_after_inputs(s, "cta >= 132"),
    "cold-after-inputs": cold_after_inputs,
    "pf-after": prefetch_after,
    "pf-wave2": prefetch_second_wave,
    "wave2-after-inputs": second_wave_after_inputs,
    "conv-bytes-only": conv_bytes_only,
    "conv-no-silu": conv_without_silu,
    "silu-no-test": silu_without_test,
    "silu-settle-kv": silu_settled_kv,
    "state-probe": probe_first_state,
    "own-window": own_window_prefetch,
    "state-evict-first": state_evict_first,
    "reads-only": reads_only,
    "no-stores": without_stores,
    "io-only": io_only,
    "l2-resident": l2_resident,
    "l2-spread": lambda s: l2_resident(s, spread=4),
    "probe-hi-only": probe_hi_only,
    "probe-lo-as-hi": probe_lo_as_hi,
    "qs-prefetch": query_start_prefetch,
    "second-meta-prefetch": second_meta_prefetch,
    "beta-at-load": beta_at_load,
    "v13-probes": v13_probes,
    "lazy-meta": lazy_meta,
    "first-lookahead-late": first_lookahead_late,
    "first-lookahead-end": lambda s: first_lookahead_late(s, at_end=True),
    "tma-window": tma_window,
    "tma-window-late": lambda s: tma_window(s, late=True),
    "balanced-grid": balanced_grid,
    "accurate-decay": accurate_decay,
    "lookahead-after-fence": lookahead_after_fence,
    "io-after-fence": lambda s: lookahead_after_fence(s, kg_too=True),
    "no-fence": without_probe_fence,
    "lookahead-wide": lookahead_wide,
    "window-guess": window_guess,
    "window-misguess": lambda s: window_guess(s, miss=True),
    "serial-coupling": serial_coupling,
    "branch-stores": branch_stores,
    "norms-free": norms_free,
    "early-states": early_states,
    "late-third": late_third,
}


def use_config(variant: Variant, config: str, records: torch.Tensor, trace: bool) -> None:
    """Build ``variant`` from its render patched by ``config`` (and the trace records)."""
    from kdagen.serve.runtime import launcher

    def patched(v: Variant) -> str:
        source = ORIGINAL_RENDER(v)
        if v != variant:
            return source
        for part in config.split("+"):  # patches chain: --config=a+b
            if part == "state-probe" and not trace:
                raise SystemExit("trace: state-probe records into the trace: add --trace")
            source = CONFIGS[part](source)
        return patch(source, records.data_ptr()) if trace else source

    krender.render = kcompile.render = patched
    launcher.cache_clear()
    # The dropped kernel's DSL module unloads its CUDA library when it is freed, which a
    # reference cycle can defer to a garbage collection; one inside the next CUDA-graph
    # capture invalidates it (cudaErrorStreamCaptureInvalidated, seen at B = 16, whose many
    # input sets make the capture long). Collect now, outside any capture.
    gc.collect()


def check_configs(variant: Variant, configs: list[str], records: torch.Tensor) -> None:
    """``kdagen check``'s cases (fp64 reference, edge cases) on each patched build: an
    experiment's timing counts only if its outputs are right."""
    from kdagen.check import check_variant

    for config in configs:
        use_config(variant, config, records, trace=False)
        cases = check_variant(variant, seed=0)
        passed = sum(c.passed for c in cases)
        worst = max(cases, key=lambda c: (not c.passed, c.score))
        out_max = max(c.out_max_rel for c in cases)
        print(f"check {config}: {passed}/{len(cases)} cases passed, out max element {out_max:.2e}")
        print(f"  worst ({worst.case}): {worst.summary()}")


def main(name: str, batches: list[int], configs: list[str], trace: bool, check: bool) -> None:
    variant = Variant.parse(name)
    records = torch.zeros(variant.ctas * SLOTS, dtype=torch.int64, device="cuda")
    if check:
        check_configs(variant, configs, records)
    bandwidth = copy_bandwidth()
    table = []
    for batch in batches:
        sets = verify_sets(variant, batch)
        row = [batch, floor_us(variant, batch, bandwidth)]
        for config in configs:
            use_config(variant, config, records, trace)
            records.zero_()
            timing = time_graph([verify_launch(s, variant) for s in sets])
            torch.cuda.synchronize()
            row.append(timing.median_us)
            if trace:
                ctas = min(variant.ctas, batch * variant.heads * variant.row_split)
                print(f"{name} B={batch} {config} (H200 trace, last launch of the graph)")
                summarise(records.cpu(), ctas, timing.median_us, row[1])
        table.append(row)
    print(f"{name}: us per launch (bench method{', traced builds' if trace else ''})")
    print("B      floor  " + "  ".join(f"{c:>12}" for c in configs))
    for row in table:
        print(f"{row[0]:<5} {row[1]:6.2f}  " + "  ".join(f"{t:12.2f}" for t in row[2:]))


if __name__ == "__main__":
    args = sys.argv[1:]
    configs = [a.split("=", 1)[1] for a in args if a.startswith("--config=")] or ["prologue"]
    rest = [a for a in args if not a.startswith("--")]
    main(rest[0], [int(b) for b in rest[1:]], configs, "--trace" in args, "--check" in args)
