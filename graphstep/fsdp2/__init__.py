"""graphstep as the optimizer of an FSDP2 (``torch.distributed.fsdp.fully_shard``) model: each DTensor param's local
shard laid out in the flat buffers (shards.py), FSDP2's tensors bound to them (bindings.py), torch's state-dict
format for torch.distributed.checkpoint (state_dict.py), and the engine that ties them (optimizer.py)."""
