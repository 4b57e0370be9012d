"""Minimal Mosaic GPU interpreter deadlock (jax 0.11.2, CPU), no project code.

A one-slot ring: a producer warpgroup copies STEPS tiles into SMEM, C consumers wait,
read and release each. Valid on the GPU (the same code with interpret=False). In the
interpreter each warpgroup is its own jitted XLA:CPU program on its own Python thread
and barrier waits are blocking io_callbacks. XLA:CPU's thunk executor offloads part of a
ready queue of more than 8 thunks (here the NV scalar fusions of the loop body) to its
intra-op thread pool (PJRT_NPROC or NPROC, default the number of CPUs), and the thunk that
depends on them (the conditional holding the barrier wait) then runs on whichever thread
finished last: often a pool thread. Once pool-size consumers block in barrier waits on
pool threads, another consumer's offloaded fusions never run, it never releases the slot,
the producer never refills it: every warpgroup waits forever.

usage: python repro_interpreter_pool_deadlock.py         # hangs where the pool has < C+1
       PJRT_NPROC=8 python repro_interpreter_pool_deadlock.py   # finishes: "ok"
       (C=3 consumers by default; on a 2-CPU machine the pool has 2 threads)
"""
import faulthandler
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

C = int(os.environ.get("C", "3"))    # consumer warpgroups
NV = int(os.environ.get("NV", "10"))  # independent scalars per step (> 8: the split)
STEPS, R = 8, 64
GPU = len(sys.argv) > 1 and sys.argv[1] == "gpu"


def body(x_ref, o_ref):
    def scoped(buf, loaded, consumed):
        wg = lax.axis_index("wg")

        @pl.when(wg == C)
        def _producer():
            @pl.loop(0, STEPS)
            def _(i):
                pl.when(i >= 1)(lambda: plgpu.barrier_wait(consumed))
                plgpu.copy_gmem_to_smem(x_ref.at[i], buf, loaded)
            plgpu.barrier_wait(consumed)

        @pl.when(wg < C)
        def _consumer():
            @pl.loop(0, STEPS)
            def _(i):
                vals = [lax.rem(i * (k + 3) + k, k + 5) for k in range(NV)]

                @pl.when(vals[0] >= 0)  # always true; the conditional takes every val
                def _():
                    plgpu.barrier_wait(loaded)
                    y = plgpu.load(buf, layout=plgpu.Layout.WGMMA)
                    for k, v in enumerate(vals):
                        o_ref.at[wg, i, k][...] = y + v.astype(jnp.float32)
                    plgpu.barrier_arrive(consumed)

    pl.run_scoped(scoped, plgpu.SMEM((R, R), jnp.float32), plgpu.Barrier(num_arrivals=1),
                  plgpu.Barrier(num_arrivals=C), collective_axes="wg")


if not GPU:
    faulthandler.dump_traceback_later(int(os.environ.get("HANG_S", "60")), exit=True)
kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((C, STEPS, NV, R, R), jnp.float32),
                      grid=(1,), grid_names=("p",), num_threads=C + 1, thread_name="wg",
                      interpret=None if GPU else plgpu.InterpretGPUParams())
x = jnp.asarray(np.random.default_rng(0).standard_normal((STEPS, R, R)), jnp.float32)
out = np.asarray(kernel(x))
i, k = np.arange(STEPS)[:, None], np.arange(NV)[None]
want = np.asarray(x)[:, None] + ((i * (k + 3) + k) % (k + 5)).astype(np.float32)[..., None, None]
np.testing.assert_array_equal(out, np.broadcast_to(want, out.shape))
print("ok", jax.devices()[0].platform)
