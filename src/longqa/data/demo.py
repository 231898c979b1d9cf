"""The embedded default run: the committed small model, synthetic data made on first use, demo.yaml."""

from __future__ import annotations

import os
from pathlib import Path

from longqa.config import Config, load_config

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
# Short contexts (~500 tokens) with 2-3 hops, like the model's warm-up data but from another seed;
# 25% held out gives 450 validation questions.
DEMO_DATA = {"rows_per_task": 600, "context_tokens": 512, "max_hops": 3, "test_ratio": 0.25, "seed": 2026}


def demo_files() -> set[str]:
    """The demo config's own data files, as absolute paths."""
    data = load_config(DEMO_CONFIG).data
    return {os.path.abspath(f) for f in (*data.train_files, *data.val_files)}


def uses_demo_data(cfg: Config) -> bool:
    """Whether every data file ``cfg`` names is one of the demo's own, which can be made on first use: so that the
    demo runs the same from its copy (``longqa train configs/demo.yaml``) or without validation
    (``data.val_files=[]``) as from no arguments at all, rather than failing on a file nobody made yet."""
    wanted = {os.path.abspath(f) for f in (*cfg.data.train_files, *cfg.data.val_files)}
    return bool(cfg.data.train_files) and wanted <= demo_files()


def ensure_demo_data(cfg: Config) -> None:
    """Generate the demo's train/val files where the config expects them, unless they exist."""
    from longqa.data.synth import generate

    wanted = [Path(f) for f in (*cfg.data.train_files, *cfg.data.val_files)]
    if all(p.is_file() for p in wanted):
        return
    roots = {p.parent.parent for p in wanted}
    if len(roots) != 1 or any(p.parent.name != "merged" for p in wanted):
        raise ValueError("the demo data files must be <dir>/merged/{train,test}.parquet")
    root = roots.pop()
    print(f"generating the demo data in {root} ...", flush=True)
    generate(root, **DEMO_DATA)
