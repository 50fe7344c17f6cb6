"""What LLDS would have done: the LLDS term evaluated on a stored run's tokens (the counterfactual of issue 31).

- `lld_monitor.counterfactual.evaluate` evaluates `lld.llds_loss` (and `lld.llds_token_flags`) on each token-logged
  step of a run; it imports torch, so only the `lld-monitor whatif` command uses it.
- `lld_monitor.counterfactual.cache` (numpy / pandas / pyarrow only) keeps the result beside the run, keyed by the
  LLDS settings and checked against the run's token rows; the dashboard reads it from there and never
  imports torch.

Nothing is imported here, so importing the package costs nothing. See docs/lld.md ("What LLDS would have
done") for what the numbers mean.
"""
