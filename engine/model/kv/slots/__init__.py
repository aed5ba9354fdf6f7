"""The KV slot backend: every running row in a slot of a pool allocated at start. `rewrite`
makes the prefill, step and copy graphs over the slots, `pool` allocates the buffers and
opens, checks and binds the sessions, `graphed` replays steps as CUDA graphs, `rows` keeps
each row's slot and `manager` the free list the scheduling policy asks."""
