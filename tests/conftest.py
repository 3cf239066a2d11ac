import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness.trace import METADATA_KEY, READABLE_VERSIONS, SCHEMA_VERSION, SUMMARY_KEY

pytest_plugins = ["pytester"]


@pytest.fixture
def schema3_copy():
    """``copy(path, out) -> out``: rewrite a current trace as schema 3 wrote
    it (the columns schema 3 lacked dropped, the version set to 3, the
    footer summary kept), to show older traces still read."""
    def copy(path: Path, out: Path) -> Path:
        source = pq.ParquetFile(path)
        table = source.read().drop_columns(list(READABLE_VERSIONS[3]))
        meta = dict(table.schema.metadata)
        info = json.loads(meta[METADATA_KEY])
        assert info["schema_version"] == SCHEMA_VERSION
        info["schema_version"] = 3
        meta[METADATA_KEY] = json.dumps(info, sort_keys=True).encode()
        with pq.ParquetWriter(out, table.schema.with_metadata(meta)) as writer:
            writer.write_table(table.replace_schema_metadata(meta))
            writer.add_key_value_metadata({SUMMARY_KEY: source.metadata.metadata[SUMMARY_KEY]})
        return out
    return copy
