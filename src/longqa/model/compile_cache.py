"""Where ``torch.compile`` keeps what it builds, so that a run started again does not build it again.

On a GPU a run compiles every decoder layer at each packed length, and the engine's decode and prefill
functions and its sampler: at Qwen3-1.7B that took 150 s before the first rollout. Inductor keeps compiled
graphs and Triton kernels on disk, keyed by everything they depend on (torch and Triton versions, the
code, the shapes, the device), and a start that finds them there skips the work; but by default it keeps
them in the system's temporary folder, which a reboot, a cleaned ``/tmp`` or another machine does not have.
Here:

- the caches live in the user's cache folder, ``$XDG_CACHE_HOME/longqa/torch-compile`` (by default
  ``~/.cache/longqa/torch-compile``), unless ``TORCHINDUCTOR_CACHE_DIR`` (torch's own setting) names another;
  Triton's kernels, longqa's own decode attention among them, go in its ``triton`` folder unless
  ``TRITON_CACHE_DIR`` names another;
- the run folder keeps a portable copy of what the run compiled, ``compile_cache.bin`` (torch's
  ``save_cache_artifacts``), written after the first step and again after any step that compiled something
  new, and loaded when a run starts in that folder: a restart on another machine (a preempted job rescheduled
  elsewhere, each node of a cluster) then finds its graphs built. Dynamo still traces each graph (seconds),
  and the fast engine captures its CUDA graphs again (no cache keeps them); the compiling is what it saves.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

RUN_CACHE_FILE = "compile_cache.bin"


def use_user_cache() -> str:
    """Point Inductor's caches (and Triton's, which live inside them) at the user's cache folder unless
    ``TORCHINDUCTOR_CACHE_DIR`` names a folder of the user's; returns the folder in use. Importing parts of
    torch sets that variable to torch's temporary default, so that value counts as unset. Call it before
    anything compiles. Triton's own cache (kernels compiled outside Inductor, like the fast engine's decode
    attention, would otherwise land in ``~/.triton``) goes inside it, unless ``TRITON_CACHE_DIR`` is set."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not given or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, "longqa", "torch-compile")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton"))
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def load_run_cache(run_dir: str | os.PathLike) -> bool:
    """Hand the run folder's ``compile_cache.bin`` to torch, if there is one, so the compilations it holds
    are found rather than redone; returns whether there was one. A file torch cannot read (another torch
    version's) is skipped with a note: it costs the compile time, nothing else."""
    path = Path(run_dir) / RUN_CACHE_FILE
    if not path.is_file():
        return False
    try:
        loaded = torch.compiler.load_cache_artifacts(path.read_bytes())  # None: torch could not read it
    except Exception as error:  # noqa: BLE001 - a stale cache only costs the time it would have saved
        loaded, why = None, f" ({type(error).__name__}: {error})"
    else:
        why = ""
    if loaded is None:
        print(f"note: {path} was not used{why}; what it held is compiled afresh", flush=True)
    return loaded is not None


def save_run_cache(run_dir: str | os.PathLike) -> int:
    """Write what this process has compiled (and loaded) to the run folder's ``compile_cache.bin``, replacing
    it whole; returns the bytes written, 0 when there is nothing to write."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data, _ = saved
    path = Path(run_dir) / RUN_CACHE_FILE
    part = path.with_name(path.name + ".part")
    part.write_bytes(data)
    part.replace(path)  # a reader never sees half a file
    return len(data)
