"""Everything a sweep writes to disk: run folders, checkpoints, trial records and the best run.

Layout (``DIR`` is ``--output-dir``)::

    DIR/run-<id>/checkpoint-<step>/   model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth,
                                      trainer_state.json, training_args.json (+ config.json;
                                      + scaler.json, fp16's gradient scaler; save_only_model:
                                      the weights and the two JSON files)
    DIR/run-<id>/trial.json           the `TrialRecord`
    DIR/best/                         the best run's model (its checkpoint without the training
                                      state), with README.md, a model card
    DIR/best_run.json                 the `BestRun` (a list of them for multi-objective sweeps)
    DIR/.trials.journal               a run folder's name each time its trial.json is written

Every file and folder is written under a temporary name and renamed into place, so a crash
leaves either the old version or the new one, never half of one. One responsibility a private
module, re-exported here: `_atomic` (atomic files and folders), `_checkpoint_files` (checkpoint
folders and RNG state), `_records` (run folders, ``trial.json``, the `BestRun` and the Pareto
front), `_best` (``best_run.json`` and ``best/`` as trials end), `_model_folder` (what of a
checkpoint ``best/`` holds, and its model card), `_index` (the records kept in memory for the
ledger). `home` (public: `open_home`) is the sweep's home, a
local folder or an object-store URL, and what is uploaded there when.
"""

from hpsweep.runs._atomic import (
    atomic_dir,
    read_json,
    recover_interrupted_swaps,
    write_json,
    write_text,
)
from hpsweep.runs._best import promote_if_best, settle_front
from hpsweep.runs._checkpoint_files import (
    CHECKPOINT_PREFIX,
    SCALER_FILE,
    CheckpointSnapshot,
    CheckpointWriter,
    checkpoints,
    latest_checkpoint,
    load_weights,
    read_checkpoint,
    resolve_checkpoint,
    resumable,
    rng_state,
    rotate_checkpoints,
    save_weights,
    set_rng_state,
    snapshot_checkpoint,
    write_checkpoint,
    write_snapshot,
)
from hpsweep.runs._index import TrialIndex
from hpsweep.runs._model_folder import (
    TRAINING_STATE,
    ModelKind,
    best_run_readme,
    card_metadata,
    card_usage,
    copy_model,
    model_files,
    model_kind_of,
)
from hpsweep.runs._records import (
    BEST_DIR,
    BEST_FILE,
    FINAL_STATES,
    JOURNAL,
    RESERVED,
    STATES,
    TRIAL_FILE,
    BestRun,
    TrialRecord,
    best_records,
    dominates,
    front_with,
    is_better,
    params_json,
    read_best,
    read_trials,
    run_dir_for,
    safe_name,
)
from hpsweep.runs.home import Home, RemoteHome, open_home

__all__ = [
    "atomic_dir",
    "read_json",
    "recover_interrupted_swaps",
    "write_json",
    "write_text",
    "CHECKPOINT_PREFIX",
    "SCALER_FILE",
    "CheckpointSnapshot",
    "CheckpointWriter",
    "checkpoints",
    "latest_checkpoint",
    "load_weights",
    "read_checkpoint",
    "resolve_checkpoint",
    "resumable",
    "rng_state",
    "rotate_checkpoints",
    "save_weights",
    "set_rng_state",
    "snapshot_checkpoint",
    "write_checkpoint",
    "write_snapshot",
    "BEST_DIR",
    "BEST_FILE",
    "FINAL_STATES",
    "JOURNAL",
    "RESERVED",
    "STATES",
    "TRIAL_FILE",
    "BestRun",
    "TrialIndex",
    "TrialRecord",
    "best_records",
    "dominates",
    "front_with",
    "is_better",
    "params_json",
    "promote_if_best",
    "read_best",
    "read_trials",
    "run_dir_for",
    "safe_name",
    "settle_front",
    "TRAINING_STATE",
    "ModelKind",
    "best_run_readme",
    "card_metadata",
    "card_usage",
    "copy_model",
    "model_files",
    "model_kind_of",
    "Home",
    "RemoteHome",
    "open_home",
]
