"""The names of the files each kind of output folder holds: a run folder (its metrics, report and checkpoints), a
checkpoint, an exported or supervised model folder. The code that writes them (``train.report``,
``train.checkpoint``, ``train.sft``) and the code that tells the folders apart (``outputs.paths``) read them here,
so neither has to import the other.
"""

from __future__ import annotations

import os
from pathlib import Path

# A run folder: its metrics (one JSON record a step), W&B's run id (so a resumed run logs to the same run), its report.
METRICS_FILE, WANDB_ID_FILE, REPORT_DIR = "metrics.jsonl", "wandb_run_id", "report"

# A checkpoint folder: the marker written last (a folder without it is unfinished) and the trainer's state.
MARKER, TRAINER_STATE = "COMPLETE", "trainer_state.json"

# Beside an exported model: the reward its run trained and validated with (its config's reward section), which
# ``longqa eval`` compares with the mode it scores in.
RUN_REWARD = "longqa_reward.json"

# The files of a Hugging Face folder that an export writes (``save_pretrained`` of a model and of its tokenizer, and
# the run's reward). An output folder that holds only such files is a previous export, which a new export replaces;
# any other file in it (an sft model card, a run's checkpoints) would end up beside weights it does not describe.
EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
    RUN_REWARD,
)

# The files ``longqa sft`` writes beside a model's: its model card and the summary by which its folders are known.
MODEL_CARD, SFT_SUMMARY = "README.md", "sft_summary.json"
MODEL_CONFIG = "config.json"  # every Hugging Face model folder's


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    """Where a run keeps its checkpoints, one ``step_*`` folder each."""
    return Path(run_dir) / "checkpoints"
