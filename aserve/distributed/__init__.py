"""Tensor parallelism (`tensor_parallel_size N`): one process per rank, a model split Megatron-style across them.

    group.py      the ranks' process group (torch.distributed: NCCL between GPUs, gloo between CPU processes) and the
                  collectives the split model and the model runner use
    sharding.py   the split itself, a transform of a model built on the meta device (the model files know nothing of
                  it): column-parallel q/k/v and gate/up, row-parallel o and down with one all-reduce each, KV heads
                  split (or replicated when there are fewer than ranks), and which slice of every checkpoint tensor a
                  rank loads
    vocab.py      the vocabulary split: the embedding (all-reduced) and lm_head (logits gathered on rank 0)

The processes themselves (rank 0 in the engine's process, ranks 1..N-1 started by it) are aserve/worker/tp_workers.py's.
"""
