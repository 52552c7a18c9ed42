"""Integrations around a sweep: MLflow, TensorBoard and W&B tracking, the HTML report and pushing to
the Hugging Face Hub.

Each lives in its own module and imports its library only when used::

    from hpsweep.integrations.mlflow import MLflowTracker      # --mlflow
    from hpsweep.integrations.tensorboard import TensorBoardTracker   # report_to="tensorboard"
    from hpsweep.integrations.wandb_runs import WandbRuns      # report_to="wandb"
    from hpsweep.integrations.html_report import write_report       # hpsweep report DIR
    from hpsweep.integrations.hub import PushToHubCallback, push_best   # hpsweep push DIR
"""

from __future__ import annotations

# Moved below the search layer, which labels --storage URLs with it; kept importable from here.
from hpsweep.redaction import is_secret_name, redact_url, scrub

__all__ = ["is_secret_name", "redact_url", "scrub"]
