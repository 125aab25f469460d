"""Chapter 7 — parallel execution on `torch.distributed` (gloo on a CPU, NCCL on GPUs): the collectives, counted
(`comm.py`), and sequence-parallel ring attention (`ring_attention.py`)."""
