"""Training data: the versioned shard schema, its writer, validating reader and validator
(``shards``), and the preparation steps that produce shard sets (``prepare``)."""

from vdtrain.data.shards import (
    MANIFEST,
    SCHEMA_VERSION,
    SampleSpec,
    ShardError,
    ShardReader,
    ShardWriter,
    ValidationReport,
    read_manifest,
    read_shards,
    validate_shards,
)

__all__ = [
    "MANIFEST",
    "SCHEMA_VERSION",
    "SampleSpec",
    "ShardError",
    "ShardReader",
    "ShardWriter",
    "ValidationReport",
    "read_manifest",
    "read_shards",
    "validate_shards",
]
