"""The in-band clock's kernel (``clocks.InbandClock``) and its three register reads, in a module of
its own: it is imported only where the clock is made, on a CUDA GPU (the interpreter has no PTX)."""

import triton
import triton.language as tl


@triton.jit
def sm_id():
    """The SM this program runs on (``%smid``)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cycles():
    """This SM's cycle counter (``%clock64``)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def global_ns():
    """The GPU's nanosecond timer (``%globaltimer``), alike on every SM."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def clock_stamp(out_ptr, max_sm):
    """One program's SM writes ``(clock64, globaltimer)`` at ``out_ptr[2 * smid]``: the in-band clock
    (launch one program per SM)."""
    sm = sm_id()
    stamp_cycles = cycles()
    stamp_ns = global_ns()
    if sm < max_sm:
        tl.store(out_ptr + 2 * sm, stamp_cycles)
        tl.store(out_ptr + 2 * sm + 1, stamp_ns)
