"""Weights & Biases: import runs into a store (`importer`), export a run's signals to W&B (`export`).
See docs/integrations.md."""
