"""Adapters that plug tiercache into other libraries: ``transformers`` (a drop-in cache and
its attention implementation, ``tiercache.integrations.transformers``)."""
