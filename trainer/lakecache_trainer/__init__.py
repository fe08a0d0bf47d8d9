"""lakecache trainer: DeepSpeed ZeRO-Offload over token shards on a lakecache mount."""
