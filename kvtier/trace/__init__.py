"""Traces of chunk references and `kvtier plan`: the reuse they show and the tier sizes they call
for. `format` (the file format and its reader), `writer` (the connector's background trace
writer), `mrc` (miss-ratio curves), `replay` (the host tier behind the device), `analysis` (the
four questions), `plan` (sizing and recommendations), `plots`, `commands` (the CLI)."""
