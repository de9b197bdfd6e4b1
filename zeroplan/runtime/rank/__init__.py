"""What runs in a probe's rank: the worker, the engines (backends), the layouts, DeepSpeed's ops, Trainer scripts."""
