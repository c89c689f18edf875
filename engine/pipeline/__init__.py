"""Stages of the trunk in other processes (`-pp N`), connected by torch.distributed.

Rank 0, the head, serves HTTP, schedules, samples, speculates and runs the embedding, stage 0's
layers, the final norm and the lm_head. Ranks 1..N-1 are workers: each owns its stage's layers and
their KV cache, nothing else. Hidden states travel round a ring, head -> 1 -> ... -> N-1 -> head,
with the step's row layout and the cache operations the head's scheduler made since the last step
(`transport`); `head` is the head's side, `worker` a worker's loop, `ranks` who is who and how the
processes start. docs/architecture.md, "Pipeline parallelism", tells the whole story.
"""
