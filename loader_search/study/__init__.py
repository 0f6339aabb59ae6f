"""The study layer: config and search space, preparing a session, the worker loop and its
budget decisions, planning a trial, recording its outcome in Optuna, and the recommendation.
Every key stored with a study or a trial is defined in `loader_search.study._keys`."""
