"""Composition roots: the live objects that wire keys, the manager, an engine and media.

``TieredKVStore`` (prefix blocks by content key) lives here; it decides nothing itself:
placement, movement and eviction are the manager's, bytes are the data plane's.
"""
