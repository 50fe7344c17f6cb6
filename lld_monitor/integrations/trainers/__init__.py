"""Trainer plug-ins: TRL (`trl.py`), verl's policy loss (`verl_loss.py`), driver hook (`verl_hook.py`) and
metrics (`verl_metrics.py`). See docs/integrations.md."""
