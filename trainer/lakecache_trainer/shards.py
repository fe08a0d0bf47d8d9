"""Token shards: the format lives in the lakecache client package, so the
trainer and `lakecache.torch` read shards the same way."""

try:
    import lakecache.shards  # noqa: F401
except ImportError as e:  # pragma: no cover (install order)
    raise ImportError(
        "lakecache-trainer needs the lakecache Python client: pip install ./pyclient "
        "(or `maturin develop` in pyclient/) before the trainer"
    ) from e

from lakecache.shards import (  # noqa: E402
    EOT,
    HEADER_BYTES,
    VOCAB_SIZE,
    ShardError,
    ShardInfo,
    encode_bytes,
    list_shards,
    read_header,
    write_shard,
)

__all__ = [
    "EOT",
    "HEADER_BYTES",
    "VOCAB_SIZE",
    "ShardError",
    "ShardInfo",
    "encode_bytes",
    "list_shards",
    "read_header",
    "write_shard",
]
