"""Several processes, one model: tensor parallelism over torch.distributed.

Rank 0 is the engine itself (``EngineCore``): it schedules, samples and talks to the front. Ranks
1..N-1 are worker processes it spawns (``workers.py``, ``worker.py``); they hold their slices of
the weights and of the KV cache and run every step rank 0 sends them. The model's parallel layers
(``layers.py``) call the group's collectives (``group.py``).
"""
