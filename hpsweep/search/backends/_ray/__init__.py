"""The Ray Tune backend: trials run as Tune trials on a local or remote Ray cluster.

- `_backend`: `RayBackend`, which runs the sweep as rounds of ``tune.Tuner.fit``;
- `_search`: what to try (hpsweep's space as Tune's, Tune's own searchers and schedulers);
- `_trial`: what runs inside a Tune trial (its claim from the ledger, its training, its report);
- `_cluster`: connecting to the cluster and shipping the space file and runs to its nodes;
- `_preflight`: what the cluster must offer before any trial (resources, storage every node reaches);
- `_stopping`: how Ctrl-C, SIGTERM, a trial's user error or trials Ray cannot place stop a round.
"""

from hpsweep.search.backends._ray._backend import RayBackend

__all__ = ["RayBackend"]
