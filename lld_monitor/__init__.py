"""lld-monitor: watch GRPO training of tool-using LLMs for the Lazy Likelihood Displacement death spiral."""

__version__ = "0.1.0"
