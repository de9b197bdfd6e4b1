"""zeroplan: memory planner and auto-tuner for ZeRO-style distributed training."""

__version__ = "0.1.0"
__all__ = ["__version__"]
