"""The sweep: what to try, how many, and what happens when something stops it.

- `options`: `SearchOptions`, what a search asks for (built by the command line and the API);
- `sweep`: `search`, which checks a search before anything is written and runs the backend;
- `space`, `space_file`, `objective`: what a space file describes;
- `job`: `SweepJob` (what every trial needs) and `SweepCallback` (the sweep's plug-in point);
- `ask_tell`: the ask/tell searcher's seam (`AskTellSearcher`, `TrialEnd`);
- `ledger_base`: the ledger's seam (`TrialLedger`, its session, what a claim hands out);
- `ledger`: counting, leases and running trials again, once for every backend;
- `sweep_loop`: the loop that claims, asks, trains and tells (here and in ``--n-jobs`` workers);
- `trial_runner`, `trial_reporter`: one trial trained and recorded, its evaluations reported;
- `torchrun`: a search in a script that torchrun started several times;
- `progress`: the live view of a sweep;
- `backends`: what to try, behind one interface (Optuna, Ray Tune, W&B).
"""
