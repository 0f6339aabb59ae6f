"""One real training run, without Optuna: the run itself, its measurements, the DataLoader it
builds, the machine facts it needs, and the forked child that isolates it (with the failure
taxonomy). The study layer asks for a trial with a `TrialJob` and gets a `TrialOutcome`."""
