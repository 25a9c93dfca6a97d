"""Tiered observability storage (`policy`: what is due and kept, pure; `archive`: how a cold
archive is encoded; `store`: the tiers and the moves; `macros`: queries over them; `loop`: the
pass run every so often): hot ClickHouse, warm Parquet on S3, cold daily archives.

A move is always copy -> verify -> commit manifest -> switch the union view -> delete source:

- hot -> warm: a closed hour partition of a hot table is written by ClickHouse itself to one
  Parquet (zstd) object with a deterministic key, read back and compared (row count and
  `sum(cityHash64(row))`) with the partition, its manifest is written, the union view is
  rebuilt to read that hour from S3, and only then is the hot partition dropped;
- warm -> cold: a closed day's warm objects are compacted into one highly compressed Parquet
  archive (encodings chosen per column, zstd 19), verified against the warm objects the same
  way, its manifest (naming its sources) written, the view rebuilt, and the warm objects and
  their manifests deleted;
- cold retention deletes an archive only when the data class's policy says it may.

A manifest is one small JSON object in the bucket, written after its data; it is what makes a
copy exist. Whatever step a crash interrupts, the next run finds the manifests and either
finishes the move (drop the source the manifest already covers) or redoes it (the deterministic
key overwrites a copy nobody committed), so data is in at least one tier and never counted
twice: the union view reads a partition from exactly one tier, chosen by the manifests.
"""
