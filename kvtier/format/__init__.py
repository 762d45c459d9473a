"""The canonical stored format: chunk keys, page and row geometry, state rows and TP shards.

What a stored chunk is, independent of any engine, device or TP degree.
"""
