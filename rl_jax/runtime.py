"""Process-wide JAX settings of the `rl-jax` commands: a persistent compilation cache,
giving the compiler's freed heap back to the OS, large host buffers that go back
to the OS when freed, and no accelerator runtime loaded on a host without the
accelerator; and the per-program XLA options of CPU programs.

The first two matter most for short runs (CPU demos, grid runs, tests): a second process
that compiles the same train step loads it from the cache instead (seconds ->
a fraction of a second on the bench workload), and a cold process does not
keep the compiler's few hundred MB of freed heap for the rest of its life.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

# Every compilation is written, however short: a warm start otherwise recompiles the
# dozens of small programs (eager ops, advantages, optimizer init) that a run starts
# with, each slower to compile than to read back (docs/results/performance.md,
# "Compute rate and compilation cache").
MIN_COMPILE_SECS = 0.0
_trim_registered = False


# LLVM's optimization level for XLA:CPU kernels (XLA's default is 2). The matmuls
# run in libraries (Eigen, YNNPACK), so the generated kernels are the elementwise
# and reduction fusions, which level 1 compiles faster without running them slower;
# level 0 runs them slower (docs/results/performance.md, "Compute rate and
# compilation cache").
CPU_LLVM_OPT_LEVEL = 1

# XLA:CPU's instruction scheduler: the memory-minimizing one orders a program's
# instructions so fewer temporaries are live at once (the default orders them for
# concurrency). The order changes no arithmetic, so results stay bit-identical, and
# the SmolLM2 recipe's peak RSS falls (docs/results/performance.md, "Under 3 GB").
CPU_SCHEDULER = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"

# glibc's mmap threshold (mallopt M_MMAP_THRESHOLD): host buffers of at least this many
# bytes get their own mapping, unmapped when freed. glibc's default threshold grows
# up to 32 MiB as large buffers are freed, after which freed arrays stay in its heap
# and the RSS only grows; fixed at 128 KiB (its starting value), a freed array's pages
# go back to the OS at once.
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

# What an accelerator shows on a Linux host: the device files of TPUs (/dev/accel*,
# /dev/vfio/* on newer generations), NVIDIA GPUs (as jax's hardware_utils checks them)
# and AMD GPUs (ROCm's /dev/kfd), and Google's PCI vendor id (TPU chips). Google's
# network and storage functions (gVNIC on every Compute Engine VM: PCI class 0x02,
# 0x01) are not TPUs.
_ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/*", "/dev/nvidia*", "/dev/dxg", "/dev/kfd")
_GOOGLE_PCI_VENDOR = "0x1ae0"
_PCI_VENDOR_FILES = "/sys/bus/pci/devices/*/vendor"
_NOT_ACCELERATOR_CLASSES = ("0x01", "0x02")  # PCI base classes: storage, network

# On a host without a TPU, libtpu loads only to compile for a TPU topology (rl-jax plan:
# the topology is named, so nothing of this host's is needed). At load it asks the TPU
# metadata this host lacks for its worker hostnames and host bounds, and prints the
# failures ("Failed to find host bounds ...", "E0000 ... unexpected worker hostname")
# before going on as if it had been told one local host. Told so, it says nothing; the
# compiled programs are the same (v5p:4x4x4, v5e:4x4, v6e:2x2: the same devices, memory
# and FLOPs). A failure that matters still raises, and rl-jax plan names it.
_LIBTPU_LOCAL_HOST = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def mesh_platform(mesh=None) -> str:
    """Platform of `mesh`'s devices ("cpu", "gpu", "tpu"); the default device's without one."""
    import jax

    return (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform


def xla_options(mesh=None, *, eigen_matmuls: bool = False, exact_rounding: bool = False) -> dict:
    """Per-`jax.jit` XLA options (`compiler_options=`) for `mesh`'s platform (default
    device without one). On accelerators XLA's defaults, but `exact_rounding`.

    eigen_matmuls: Eigen matmuls instead of YNNPACK fusions (CPU). On the bench
    workload's train step that is about 5-10% faster and needs 15% less temporary
    memory (the YNNPACK fusions want their own operand layouts, hence extra copies); the
    sampler's small decode matmuls keep YNNPACK.
    exact_rounding: XLA's excess precision off (`model.exact_rounding`): a fusion rounds
    every intermediate to its dtype as the program says, not as the fusion happens to
    keep it, so two programs computing the same op round it alike.
    """
    exact = {"xla_allow_excess_precision": False} if exact_rounding else {}
    if mesh_platform(mesh) != "cpu":
        return exact
    opts: dict = {
        **exact,
        "xla_backend_optimization_level": CPU_LLVM_OPT_LEVEL,
        "xla_cpu_scheduler_type": CPU_SCHEDULER,
    }
    if eigen_matmuls:
        opts["xla_cpu_experimental_ynn_fusion_type"] = ""
    return opts


def xla_flags_with_device_count(flags: str, count: int | None) -> str:
    """`flags` (an XLA_FLAGS value) with its fake CPU device count replaced by `count`
    (dropped for None), the other flags kept: for a child process (a benchmark worker,
    one process of a multi-process test) that sets its own device count and keeps its
    parent's compile settings. Set before the child's JAX starts its CPU backend."""
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    if count is not None:
        kept.append(f"--xla_force_host_platform_device_count={count}")
    return " ".join(kept)


def compile_cache_dir() -> Path | None:
    """JAX_COMPILATION_CACHE_DIR if set; else $XDG_CACHE_HOME/rl_jax/jax (~/.cache by
    default); None when RL_JAX_COMPILE_CACHE=0 turns the cache off."""
    if os.environ.get("RL_JAX_COMPILE_CACHE", "1") == "0":
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    return user_cache_dir("jax")


def user_cache_dir(name: str) -> Path:
    """$XDG_CACHE_HOME/rl_jax/<name> (~/.cache by default): rl_jax's per-user caches."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rl_jax" / name


def enable_compile_cache(path: str | Path | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at `path` (default compile_cache_dir())."""
    import jax

    path = Path(path) if path is not None else compile_cache_dir()
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    return path


def trim_heap_after_compiles() -> bool:
    """After every XLA compilation, return the heap it freed to the OS (glibc only).

    Compiling a train step takes a few hundred MB that glibc keeps, fragmented
    over its arenas, after the compiler frees it; the step's own temporaries then
    come on top, so a cold process peaks that much higher than a warm-cache one.
    malloc_trim(0) takes a few milliseconds. Returns whether the hook is active.
    """
    global _trim_registered
    if _trim_registered:
        return True
    import ctypes

    from jax import monitoring

    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False

    def on_event(name: str, secs: float, **_) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            trim(0)

    monitoring.register_event_duration_secs_listener(on_event)
    _trim_registered = True
    return True


def unmap_freed_buffers() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD, so that a freed large host buffer
    is unmapped instead of kept in the heap (glibc only; a no-op elsewhere). Returns
    whether it is set."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def accelerator_visible() -> bool:
    """Whether this host shows an accelerator's device file or a Google PCI function
    (see _ACCELERATOR_FILES); True off Linux, where there is nothing to look at."""
    if not sys.platform.startswith("linux"):
        return True
    if any(glob.glob(pattern) for pattern in _ACCELERATOR_FILES):
        return True
    for vendor in glob.glob(_PCI_VENDOR_FILES):
        try:
            if Path(vendor).read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            cls = Path(vendor).with_name("class")
            if not (cls.is_file() and cls.read_text().startswith(_NOT_ACCELERATOR_CLASSES)):
                return True
        except OSError:
            continue
    return False


def quiet_libtpu() -> bool:
    """On a host without an accelerator (and without JAX_FORCE_TPU_INIT), tell libtpu it
    is one local host (_LIBTPU_LOCAL_HOST, where not set already), so that loading it to
    compile for a TPU topology prints nothing. Call before libtpu loads. Returns whether
    it did."""
    if "JAX_FORCE_TPU_INIT" in os.environ or accelerator_visible():
        return False
    for key, value in _LIBTPU_LOCAL_HOST.items():
        os.environ.setdefault(key, value)
    return True


def cpu_without_accelerators() -> bool:
    """Start only JAX's CPU backend (jax_platforms='cpu') when the user chose no
    platforms (JAX_PLATFORMS) and the host shows no accelerator; returns whether it did.
    Call before JAX's backends start (the first device query or computation).

    With no platforms chosen, JAX tries every backend whose plugin is installed. Where
    libtpu is installed (rl-jax plan compiles for TPU topologies with it) that loads and
    initialises the 660 MiB library even on a host without a TPU: it fails (the
    "could not determine TPU accelerator type" lines) and JAX runs on the CPU, the same
    devices as here, having spent 94 MiB of resident memory on it for the rest of the
    process (89 MiB of the library's pages; docs/results/performance.md). JAX skips CUDA the
    same way when no NVIDIA device file exists. A host with any accelerator visible, or
    JAX_FORCE_TPU_INIT set, keeps JAX's own choice.
    """
    import jax

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return False
    if "JAX_FORCE_TPU_INIT" in os.environ or accelerator_visible():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


def setup() -> None:
    """All of the above, for a command about to compile."""
    quiet_libtpu()
    cpu_without_accelerators()
    enable_compile_cache()
    trim_heap_after_compiles()
    unmap_freed_buffers()
