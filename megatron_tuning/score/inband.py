"""The in-band clock's kernel (``clocks.InbandClock``), in a module of its own: it is imported only
where the clock is made, on a CUDA GPU."""

import triton
import triton.language as tl


@triton.jit
def clock_stamp(out_ptr, max_sm):
    """One program's SM writes ``(clock64, globaltimer)`` at ``out_ptr[2 * smid]``: the in-band clock
    (launch one program per SM; CUDA only: the interpreter has no PTX)."""
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    cycles = tl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    ns = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    if sm < max_sm:
        tl.store(out_ptr + 2 * sm, cycles)
        tl.store(out_ptr + 2 * sm + 1, ns)
