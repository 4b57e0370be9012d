"""Settings every test module needs before JAX starts its CPU client."""

import os
import pathlib
import shutil
import tempfile

import pytest

# NOTE: the Mosaic GPU interpreter (JAX 0.11.2) runs each simulated warpgroup as an
# XLA:CPU program of its own, a barrier wait as a blocking host callback. XLA:CPU runs
# parts of a program on its intra-op thread pool (one thread per CPU unless PJRT_NPROC
# says otherwise) and carries on with the program on the thread that finished them, so a
# warpgroup's barrier wait can block a pool thread. Once the waits hold every pool
# thread, a warpgroup whose work is queued on the pool never runs again and the kernel
# deadlocks, every warpgroup waiting on a barrier (tools/repro_interpreter_pool_deadlock.py).
# On a 2-CPU machine that hung the dQ kernel's four warpgroups on bottom-right causal
# T > S problems. A pool well above any kernel's warpgroups (at most 4) avoids it.
os.environ.setdefault("PJRT_NPROC", str(max(16, os.cpu_count() or 1)))

# Eight CPU devices for the multi-device tests (sharding under jit, ring attention);
# single-device tests run on the first as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# NOTE: at the tests' sizes the interpreted kernels run in milliseconds; the time goes
# into compiling them (large XLA programs: every kernel body, its tile loops and the
# interpreter's state handling). LLVM optimisation level 0 compiles every program of the
# suite faster and changes no semantics (same HLO, no fast math). LLVM's expensive passes
# are turned off as well: they still run at level 0 (turning them off took 7-13% off
# test_kernels.py and test_mosaic_forward.py run alone), and they change no semantics.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
if "xla_llvm_disable_expensive_passes" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_llvm_disable_expensive_passes=true"

# NOTE: the interpreters build each kernel's programs afresh per call, so JAX's
# in-memory caches miss where the same program compiles again; a compilation cache keyed
# on the program spares those compiles. The run's first process (xdist's controller)
# makes a fresh directory, its workers inherit it, and it removes it at the end.
_OWNS_CACHE = "PALLAS_ATTN_TEST_CACHE" not in os.environ
if _OWNS_CACHE:
    os.environ["PALLAS_ATTN_TEST_CACHE"] = tempfile.mkdtemp(prefix="pallas_attn-test-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["PALLAS_ATTN_TEST_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_sessionfinish(session):
    if _OWNS_CACHE:
        shutil.rmtree(os.environ["PALLAS_ATTN_TEST_CACHE"], ignore_errors=True)


# The extended tier (tests/extended.txt): listed tests and cases carry the `extended`
# mark, which `bash scripts/run.sh test` deselects so that CI stays within its time.
_EXTENDED = pathlib.Path(__file__).with_name("extended.txt")


def _extended_entries() -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in _EXTENDED.read_text().splitlines())
    return {line for line in lines if line}


def extended_nodes(entries: set[str], nodes: list[str], args: list[str]
                   ) -> tuple[set[str], list[str]]:
    """(the node ids under tests/ that an entry names, as a test or one case; the entries of
    a collected module that name no node, unless an argument picked tests by name)."""
    marked, matched = set(), set()
    for node in nodes:
        for entry in (node, node.split("[", 1)[0]):
            if entry in entries:
                marked.add(node)
                matched.add(entry)
    modules = {node.split("::", 1)[0] for node in nodes}
    stale = sorted(e for e in entries - matched if e.split("::", 1)[0] in modules
                   and not any("::" in arg for arg in args))
    return marked, stale


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    nodes = [item.nodeid.removeprefix("tests/") for item in items]
    marked, stale = extended_nodes(_extended_entries(), nodes, config.args)
    # A stale entry would let a renamed case move into CI's tier unnoticed.
    if stale:
        raise pytest.UsageError(f"tests/extended.txt names no collected case: {stale}")
    for item, node in zip(items, nodes, strict=True):
        if node in marked:
            item.add_marker(pytest.mark.extended)
