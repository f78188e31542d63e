"""Adapters that plug tiercache into other libraries: ``transformers`` (a drop-in cache and
its attention implementation, ``tiercache.integrations.transformers``)."""

from ..extras import require

require("torch", "transformers", what="tiercache.integrations (the transformers cache)")
