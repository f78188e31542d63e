"""Adapters that plug tiercache into other libraries: ``transformers`` (a drop-in cache and
its attention implementation, ``tiercache.integrations.transformers``). The modules that
import transformers check for it first (``extras.require``: the message names the ``hf``
extra); the others (``causal``) need torch only."""
