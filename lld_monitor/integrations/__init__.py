"""lld-monitor beside other tools, in two kinds:

- `trainers/`: plug-ins that bring lld-monitor's signals (and LLDS) into other trainers: TRL's
  `GRPOTrainer` (`trl.py`), verl's policy loss (`verl_loss.py`), verl's driver (`verl_hook.py`) and verl's
  metrics dict (`verl_metrics.py`). Each turns its trainer's tensors into a step through `lld_monitor.payload`.
- `wandb/`: Weights & Biases, both ways: runs imported into a store (`importer.py`, from the API or from offline
  `.wandb` files read by `offline_file.py`; what the import decides about a run is `run_profile.py`, the rows it
  writes `write_run.py` and `completions.py`), and a store's signals exported to a live W&B run (`export.py`, a
  RunLogger sink).
"""
