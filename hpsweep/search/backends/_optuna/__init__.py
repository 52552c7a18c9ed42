"""The Optuna backend: a study in the sweep folder's journal or in a database machines share.

- `_backend`: `OptunaBackend`, the ask/tell backend (Optuna's samplers and pruners);
- `_storages`: where the study lives (``--storage``), parsed and opened;
- `_journal`: the sweep folder's journal file and its lock;
- `_retrying_storage`: a database that may go away for a while (every call waits for it);
- `_study_ledger`: the sweep's ledger kept in the study itself, for machines that share it;
- `_dashboard`: optuna-dashboard on a sweep's study (``hpsweep dashboard``).
"""

from hpsweep.search.backends._optuna._backend import OptunaBackend

__all__ = ["OptunaBackend"]
